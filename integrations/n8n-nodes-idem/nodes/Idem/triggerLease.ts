/**
 * Where Complete, Fail and Heartbeat find the claim in a workflow started by the Idem Trigger.
 *
 * n8n's nodes replace the item as it flows (an HTTP Request's output is the downstream's
 * answer), so by the time Complete runs, `$json.idem` (the default Key and Lease Token) may be
 * gone. The trigger's own output still holds its claim: when a Key or Lease Token is empty,
 * both are taken from there, so Idem Trigger → HTTP Request → Complete with the defaults
 * completes the trigger's claim. Nothing here imports n8n (`node --test` checks it).
 */

import type { JsonMap } from './protocol';

/** The Idem Trigger's node type ends so, whatever the package's prefix in an n8n instance. */
export const TRIGGER_TYPE_SUFFIX = '.idemTrigger';

export interface Lease {
	key: string;
	leaseToken: string;
}

function text(value: unknown): string {
	return value === undefined || value === null ? '' : String(value).trim();
}

/** The trigger nodes among a node's ancestors (n8n's `getParentNodes`), nearest first. */
export function triggerNames(parents: Array<{ name: string; type: string }>): string[] {
	return parents.filter((node) => node.type.endsWith(TRIGGER_TYPE_SUFFIX)).map((node) => node.name);
}

/**
 * The key and lease token to send: the parameters when both are set; otherwise the trigger's
 * claim (its item's `idem`), both from there, unless a parameter that is set names another
 * claim (then the parameters stand and the request says which one is empty). Never one from
 * each: a key with another claim's token is refused by the gateway as `lease_lost`.
 */
export function leaseToUse(given: { key: unknown; leaseToken: unknown }, trigger: JsonMap | undefined): Lease {
	const key = text(given.key);
	const leaseToken = text(given.leaseToken);
	if ((key && leaseToken) || trigger === undefined) return { key, leaseToken };
	const triggerKey = text(trigger.key);
	const triggerToken = text(trigger.lease_token);
	if (!triggerKey || !triggerToken) return { key, leaseToken };
	if ((key && key !== triggerKey) || (leaseToken && leaseToken !== triggerToken)) return { key, leaseToken };
	return { key: triggerKey, leaseToken: triggerToken };
}
