/**
 * The Idem Trigger's decisions as plain functions (no n8n, no network), so `node --test`
 * checks them: the Standard Webhooks signature of a gateway delivery, the claim key a delivery
 * is held under, and what to do with each answer of the claims API.
 *
 *   201 claimed               start the execution (the item carries the lease token): on
 *                             Act, or on Look First when the claim is `uncertain` (an earlier
 *                             execution's lease ran out or it failed: it may have acted)
 *   200 already_succeeded     answer 200 with the stored result; start nothing
 *   409 in_progress           answer 409 {"idem": "in_progress", "retry_after": N}: the
 *                             gateway waits N s and sends again without spending an attempt
 *   409 failed_final /        answer 409 {"idem": <status>}: a plain 409 is permanent for the
 *       quarantined           gateway, which dead-letters the key for an operator
 *   unavailable (5xx, 408,    answer 503 with Retry-After: the gateway retries later
 *       429, no answer)
 *   any other refusal         answer 502 {"idem": "refused", "error"} (a wrong claims token, a
 *                             changed payload): retried by the gateway, visible in its logs
 */

import { createHash, createHmac, timingSafeEqual } from 'crypto';

import { answerFields, header, isUnavailable, parseBody, type GatewayAnswer, type JsonMap } from '../Idem/protocol';

/** Standard Webhooks: a timestamp further than this from now is refused (replays). */
export const TIMESTAMP_TOLERANCE_SECONDS = 300;

/** The claims API's key limit. */
const MAX_KEY_LENGTH = 255;

/** What a delivery's claim key starts with: it never collides with the gateway's event key. */
export const CLAIM_KEY_PREFIX = 'n8n-trigger:';

/** The in-progress wait when the claims answer names none, and its bounds. */
export const IN_PROGRESS_DEFAULT_SECONDS = 5;
const IN_PROGRESS_MAX_SECONDS = 300;

export const DEFAULT_LEASE_SECONDS = 300;

/** The key bytes of a `whsec_…` secret (the prefix optional); throws on a non-base64 secret. */
export function decodeSecret(secret: string): Buffer {
	const encoded = secret.trim().replace(/^whsec_/, '');
	if (!encoded || !/^[A-Za-z0-9+/]+={0,2}$/.test(encoded) || encoded.length % 4 !== 0) {
		throw new Error('A signing secret is whsec_ followed by base64');
	}
	return Buffer.from(encoded, 'base64');
}

/** Several secrets (a rotation) separated by spaces, commas or new lines. */
export function splitSecrets(text: string | undefined): string[] {
	return (text ?? '')
		.split(/[\s,]+/)
		.map((one) => one.trim())
		.filter(Boolean);
}

/** `v1,<base64 HMAC-SHA256(key, "<id>.<timestamp>.<body>")>`, the Standard Webhooks signature. */
export function standardSignature(secret: string, id: string, timestamp: string | number, body: Buffer | string): string {
	const mac = createHmac('sha256', decodeSecret(secret));
	mac.update(`${id}.${timestamp}.`);
	mac.update(typeof body === 'string' ? Buffer.from(body, 'utf8') : body);
	return `v1,${mac.digest('base64')}`;
}

export interface Delivery {
	id?: string;
	timestamp?: string;
	signature?: string;
	/** The exact bytes received. */
	body: Buffer | string;
}

export type Verdict = { ok: true } | { ok: false; reason: string };

/**
 * Whether a delivery carries a valid signature under one of `secrets`: all three headers
 * present, the timestamp within the tolerance of `nowSeconds`, and one of the header's
 * space-separated `v1,…` signatures equal (in constant time) to the one computed.
 */
export function verifyDelivery(
	secrets: string[],
	delivery: Delivery,
	nowSeconds: number,
	toleranceSeconds = TIMESTAMP_TOLERANCE_SECONDS,
): Verdict {
	if (secrets.length === 0) return { ok: false, reason: 'no signing secret is configured' };
	const { id, timestamp, signature } = delivery;
	if (!id || !timestamp || !signature) {
		return { ok: false, reason: 'webhook-id, webhook-timestamp or webhook-signature is missing' };
	}
	if (!/^\d{1,12}$/.test(timestamp)) return { ok: false, reason: 'webhook-timestamp is not a unix time' };
	if (Math.abs(nowSeconds - Number(timestamp)) > toleranceSeconds) {
		return { ok: false, reason: 'webhook-timestamp is too far from now' };
	}
	const offered = signature
		.split(' ')
		.filter((one) => one.startsWith('v1,'))
		.map((one) => Buffer.from(one.slice(3), 'utf8'));
	for (const secret of secrets) {
		const wanted = Buffer.from(standardSignature(secret, id, timestamp, delivery.body).slice(3), 'utf8');
		for (const candidate of offered) {
			if (candidate.length === wanted.length && timingSafeEqual(candidate, wanted)) return { ok: true };
		}
	}
	return { ok: false, reason: 'no signature matches' };
}

/** What follows the prefix in a hashed claim key, and in no key written as it is. */
export const HASHED_MARK = 'sha256:';

/**
 * The claim key of a delivery: the gateway's key (`webhook-id`) under a prefix of its own, so
 * the claims API does not answer `not_a_claim_key` (the gateway's key belongs to its event).
 * A key too long for the prefix, or not printable ASCII, is hashed: `n8n-trigger:sha256:<hex>`.
 * So is a key that itself starts with `sha256:` (a source named `sha256` sending its own
 * `Idempotency-Key`), so a key written as it is never reads as a hashed one and two gateway
 * keys never share a claim. Every other key's claim is what it was, hashed ones included.
 */
export function claimKeyFor(webhookId: string): string {
	const key = `${CLAIM_KEY_PREFIX}${webhookId}`;
	const plain = key.length <= MAX_KEY_LENGTH && /^[\x21-\x7e]+$/.test(key);
	if (plain && !webhookId.startsWith(HASHED_MARK)) return key;
	return `${CLAIM_KEY_PREFIX}${HASHED_MARK}${createHash('sha256').update(webhookId, 'utf8').digest('hex')}`;
}

export interface Reply {
	statusCode: number;
	body: JsonMap;
	headers: Record<string, string>;
}

export type TriggerAction = { start: true; idem: JsonMap } | { start: false; reply: Reply };

function retryAfterSeconds(answer: GatewayAnswer): number {
	const fromBody = Number(parseBody(answer.body).retry_after);
	const fromHeader = Number(header(answer.headers, 'retry-after'));
	const wanted = Number.isFinite(fromBody) && fromBody > 0
		? fromBody
		: Number.isFinite(fromHeader) && fromHeader > 0
			? fromHeader
			: IN_PROGRESS_DEFAULT_SECONDS;
	return Math.min(Math.max(Math.ceil(wanted), 1), IN_PROGRESS_MAX_SECONDS);
}

/** What the trigger does with the claims API's answer (`undefined`: no answer at all). */
export function triggerAction(answer: GatewayAnswer | undefined): TriggerAction {
	if (answer === undefined || isUnavailable(answer.statusCode)) {
		const code = answer === undefined ? 'gateway_unreachable' : `claims_http_${answer.statusCode}`;
		return {
			start: false,
			reply: { statusCode: 503, body: { idem: 'unavailable', error: code }, headers: { 'Retry-After': '5' } },
		};
	}
	const body = parseBody(answer.body);
	const status = body.status;
	if (answer.statusCode === 201 && status === 'claimed') {
		return { start: true, idem: answerFields(answer, 'claim') };
	}
	if (answer.statusCode === 200 && status === 'already_succeeded') {
		const result = body.result;
		const stored: JsonMap =
			result !== null && typeof result === 'object' && !Array.isArray(result) ? result : { result: result ?? null };
		return { start: false, reply: { statusCode: 200, body: stored, headers: { 'Idempotent-Replayed': 'true' } } };
	}
	if (answer.statusCode === 409 && status === 'in_progress') {
		const seconds = retryAfterSeconds(answer);
		return {
			start: false,
			reply: {
				statusCode: 409,
				body: { idem: 'in_progress', retry_after: seconds },
				headers: { 'Retry-After': String(seconds) },
			},
		};
	}
	if (answer.statusCode === 409 && (status === 'failed_final' || status === 'quarantined')) {
		const reply: JsonMap = { idem: status };
		if (typeof body.error_code === 'string') reply.error_code = body.error_code;
		return { start: false, reply: { statusCode: 409, body: reply, headers: {} } };
	}
	const fields = answerFields(answer, 'claim');
	return {
		start: false,
		reply: {
			statusCode: 502,
			body: { idem: 'refused', error: fields.error ?? `claims_http_${answer.statusCode}`, claims_status: answer.statusCode },
			headers: {},
		},
	};
}

/** The trigger's outputs, in order: a first run acts, a re-run after an uncertain one looks. */
export const TRIGGER_OUTPUT_NAMES = ['Act', 'Look First'] as const;
export const ACT_OUTPUT = 0;
export const LOOK_FIRST_OUTPUT = 1;

/** The output a claimed delivery starts on: Look First when the claim says `uncertain`. */
export function triggerOutput(claim: JsonMap): number {
	return claim.uncertain === true ? LOOK_FIRST_OUTPUT : ACT_OUTPUT;
}

/**
 * The execution's item: the event (the delivery's body), the gateway's key, the claim's
 * attempt and `uncertain`, the earlier attempt's error code (`previous_error_code`, on Look
 * First), the correlation id, and under `idem` the claim (its key and lease token), where the
 * Idem node's Heartbeat, Complete and Fail find it.
 */
export function triggerItem(input: {
	event: unknown;
	gatewayKey: string;
	claimKey: string;
	claim: JsonMap;
	correlationId?: string;
}): JsonMap {
	const { claim } = input;
	const correlationId =
		input.correlationId || (typeof claim.correlation_id === 'string' ? claim.correlation_id : undefined);
	const item: JsonMap = {
		event: (input.event ?? null) as JsonMap,
		key: input.gatewayKey,
		attempt: typeof claim.attempt === 'number' ? claim.attempt : 1,
		uncertain: claim.uncertain === true,
		previous_error_code: typeof claim.previous_error_code === 'string' ? claim.previous_error_code : null,
		idem: { ...claim, key: input.claimKey, gateway_key: input.gatewayKey },
	};
	if (correlationId) item.correlation_id = correlationId;
	return item;
}
