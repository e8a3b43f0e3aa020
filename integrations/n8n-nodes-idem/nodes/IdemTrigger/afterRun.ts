/**
 * What the Idem Trigger answers the gateway once its execution has ended, as plain functions
 * (no n8n): n8n's own answer (the last node's first item, or its error) is turned into the
 * claim's outcome and one answer whatever the timing.
 *
 *   the workflow ended with an item   complete the claim with the clean result (the item
 *                                     without `idem`, where the lease token travels); when the
 *                                     workflow's Complete recorded a result first, that one
 *                                     stands. Answer 200 with the stored result: the same body
 *                                     a re-send after the run gets from the claim
 *   the workflow failed               fail the claim (retryable, effect unknown: some nodes
 *                                     may have acted) so the next delivery does not wait for
 *                                     the lease; answer 500 {"idem": "failed", "retryable":
 *                                     true, "error_code", "effect"}: transient for the gateway
 *   the workflow's Fail recorded      answer by the claim's state: failed_final (not
 *     the outcome itself              retryable) 409 {"idem": "failed_final"}, permanent for
 *                                     the gateway; retryable the 500 above
 *   the claims API cannot be reached  502 {"idem": "unavailable"}: the gateway sends again and
 *                                     the claim answers (held until its lease ends, then Look
 *                                     First)
 */

import {
	completeRequest,
	failRequest,
	getEventRequest,
	isUnavailable,
	parseBody,
	type GatewayAnswer,
	type GatewayRequest,
	type IdemCredentials,
	type Json,
	type JsonMap,
} from '../Idem/protocol';
import type { Reply } from './trigger';

/** The error code a workflow that failed leaves on its claim. */
export const WORKFLOW_FAILED = 'n8n_workflow_failed';

/** n8n's answer at the end of the execution, before the trigger turns it into its own. */
export interface RunAnswer {
	statusCode: number;
	body: unknown;
}

/** The claim the execution holds. */
export interface HeldClaim {
	credentials: IdemCredentials;
	key: string;
	leaseToken: string;
}

/** Sends one request to the gateway: its answer, or undefined when none came. */
export type Call = (request: GatewayRequest) => Promise<GatewayAnswer | undefined>;

function isMap(value: unknown): value is JsonMap {
	return typeof value === 'object' && value !== null && !Array.isArray(value);
}

/**
 * What a stored result is made of: the last item without `idem` (the claim, its lease token
 * included, which no stored result may carry); a value that is not an object as `{result}`.
 */
export function cleanResult(body: unknown): JsonMap {
	if (isMap(body)) {
		const result: JsonMap = { ...body };
		delete result.idem;
		return result;
	}
	return { result: (body ?? null) as Json };
}

/** A stored result as the trigger answers it (the claim's `result` may be any JSON value). */
export function storedAnswer(result: unknown): Reply {
	return { statusCode: 200, body: isMap(result) ? result : { result: (result ?? null) as Json }, headers: {} };
}

function failedAnswer(retryable: boolean, errorCode: string, effect: 'unknown' | 'none'): Reply {
	if (!retryable) {
		return { statusCode: 409, body: { idem: 'failed_final', error_code: errorCode }, headers: {} };
	}
	return { statusCode: 500, body: { idem: 'failed', retryable: true, error_code: errorCode, effect }, headers: {} };
}

const UNAVAILABLE: Reply = {
	statusCode: 502,
	body: { idem: 'unavailable', error: 'gateway_unreachable' },
	headers: { 'Retry-After': '5' },
};

/** A run counts as ended well when n8n answered 2xx (the last node's first item). */
export function runSucceeded(run: RunAnswer): boolean {
	return run.statusCode >= 200 && run.statusCode < 300;
}

/** n8n's message for a failed run (`Error in workflow`, `No item to return was found` ...). */
export function runMessage(run: RunAnswer): string {
	const body = parseBody(run.body);
	const message = typeof body.message === 'string' ? body.message : `n8n answered ${run.statusCode}`;
	return message.slice(0, 500);
}

/**
 * The answer by the key's state (`GET /v1/events/{key}`), when the execution's own complete or
 * fail did not record the outcome: a Complete or Fail node in the workflow did, or the lease
 * ran out and another execution holds the key now.
 */
export function answerFromState(answer: GatewayAnswer | undefined): Reply {
	if (answer === undefined || isUnavailable(answer.statusCode) || answer.statusCode !== 200) return UNAVAILABLE;
	const state = parseBody(answer.body);
	const status = String(state.status);
	const errorCode = typeof state.error_code === 'string' ? state.error_code : WORKFLOW_FAILED;
	if (status === 'succeeded') return storedAnswer(state.result);
	if (status === 'failed_final' || status === 'quarantined') {
		return { statusCode: 409, body: { idem: status, error_code: errorCode }, headers: {} };
	}
	if (status === 'processing') {
		return {
			statusCode: 409,
			body: { idem: 'in_progress', retry_after: 5 },
			headers: { 'Retry-After': '5' },
		};
	}
	return failedAnswer(true, errorCode, state.uncertain === false ? 'none' : 'unknown');
}

/** The claims API recorded this call's own outcome (not a repeat of an earlier call's). */
function recorded(answer: GatewayAnswer | undefined, status: string): boolean {
	if (answer === undefined || answer.statusCode !== 200) return false;
	const body = parseBody(answer.body);
	return body.status === status && body.repeated !== true;
}

/** Records the run's outcome under the claim and says what to answer the gateway. */
export async function answerAfterRun(run: RunAnswer, claim: HeldClaim, call: Call): Promise<Reply> {
	const { credentials, key, leaseToken } = claim;
	if (runSucceeded(run)) {
		const result = cleanResult(run.body);
		const done = await call(completeRequest(credentials, { key, leaseToken, result }));
		if (recorded(done, 'succeeded')) return storedAnswer(result);
		if (done === undefined || isUnavailable(done.statusCode)) return UNAVAILABLE;
	} else {
		const failed = await call(
			failRequest(credentials, {
				key,
				leaseToken,
				errorCode: WORKFLOW_FAILED,
				retryable: true,
				effect: 'unknown',
				detail: runMessage(run),
			}),
		);
		if (recorded(failed, 'failed_retryable')) return failedAnswer(true, WORKFLOW_FAILED, 'unknown');
		if (failed === undefined || isUnavailable(failed.statusCode)) return UNAVAILABLE;
	}
	return answerFromState(await call(getEventRequest(credentials, key)));
}
