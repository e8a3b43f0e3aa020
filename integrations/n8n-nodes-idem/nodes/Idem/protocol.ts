/**
 * The gateway's HTTP contract as plain functions: the request each operation sends, and what
 * each answer means. Nothing here imports n8n, so `node --test` checks it without n8n or a
 * network; `Idem.node.ts` only reads parameters, sends, and places items on outputs.
 *
 * Every answer is one of three kinds:
 *
 *   unavailable   no answer, 408, 429 or 5xx: nothing can be concluded, so the node throws
 *                 and n8n's Retry On Fail / error output take over (the gateway changed
 *                 nothing, or the request is safe to repeat: a claim is idempotent by its key,
 *                 a complete or fail by its lease token)
 *   refused       another 4xx or a 409 that is not a claim outcome (`lease_lost`,
 *                 `not_a_claim_key`, `idempotency_key_reused`, `unauthorized` ...): a claim
 *                 goes to its Refused output, any other operation throws (n8n's error output
 *                 or a failed execution); `idem.status` is `refused`, `idem.error` the code
 *   answered      2xx, and for a claim the 200/201/409 outcomes routed below
 */

import { createHmac } from 'crypto';

export interface IdemCredentials {
	baseUrl: string;
	claimsToken?: string;
	operatorToken?: string;
	signingSecret?: string;
}

export interface GatewayRequest {
	method: 'GET' | 'POST';
	url: string;
	headers: Record<string, string>;
	/** The exact text sent: a signature covers these bytes. */
	body?: string;
}

export interface GatewayAnswer {
	statusCode: number;
	headers: Record<string, unknown>;
	/** The raw text (or an already parsed object). */
	body: unknown;
}

export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };
export type JsonMap = { [key: string]: Json };

/** A parameter the node cannot send: the user has to fix the workflow. */
export class IdemInputError extends Error {}

// ------------------------------------------------------------------ requests

function base(credentials: IdemCredentials): string {
	const url = (credentials.baseUrl || '').trim().replace(/\/+$/, '');
	if (!/^https?:\/\//.test(url)) {
		throw new IdemInputError(`The credential's Base URL must start with http:// or https:// (got "${url}")`);
	}
	return url;
}

function required(value: unknown, label: string): string {
	const text = value === undefined || value === null ? '' : String(value).trim();
	if (!text) {
		throw new IdemInputError(`${label} is empty`);
	}
	return text;
}

function claimPath(credentials: IdemCredentials, key: string, action?: string): string {
	const path = `${base(credentials)}/v1/claims/${encodeURIComponent(required(key, 'Key'))}`;
	return action ? `${path}/${action}` : path;
}

/** Claims calls carry the claims token; without one the gateway serves only its own machine. */
function claimsHeaders(credentials: IdemCredentials): Record<string, string> {
	const headers: Record<string, string> = { 'Content-Type': 'application/json', Accept: 'application/json' };
	if (credentials.claimsToken) {
		headers.Authorization = `Bearer ${credentials.claimsToken}`;
	}
	return headers;
}

/** JSON text without the members left undefined (the gateway forbids unknown or null ones). */
function jsonBody(members: Record<string, unknown>): string {
	const kept: Record<string, unknown> = {};
	for (const [name, value] of Object.entries(members)) {
		if (value !== undefined) kept[name] = value;
	}
	return JSON.stringify(kept);
}

function optionalText(value: unknown): string | undefined {
	const text = value === undefined || value === null ? '' : String(value).trim();
	return text ? text : undefined;
}

function leaseSeconds(value: unknown): number | undefined {
	if (value === undefined || value === null || value === '') return undefined;
	const seconds = Number(value);
	if (!Number.isInteger(seconds) || seconds < 1 || seconds > 3600) {
		throw new IdemInputError(`Lease seconds must be a whole number from 1 to 3600 (got ${String(value)})`);
	}
	return seconds;
}

/** A JSON parameter: n8n hands over an object, or the text typed into the field. */
export function jsonParameter(value: unknown, label: string): Json | undefined {
	if (value === undefined || value === '') return undefined;
	if (typeof value === 'string') {
		try {
			return JSON.parse(value) as Json;
		} catch {
			throw new IdemInputError(`${label} is not valid JSON`);
		}
	}
	return value as Json;
}

export interface ClaimInput {
	key: string;
	payload?: Json;
	leaseSeconds?: number | string;
	workflow?: string;
	correlationId?: string;
}

export function claimRequest(credentials: IdemCredentials, input: ClaimInput): GatewayRequest {
	return {
		method: 'POST',
		url: `${base(credentials)}/v1/claims`,
		headers: claimsHeaders(credentials),
		body: jsonBody({
			key: required(input.key, 'Key'),
			payload: input.payload,
			lease_seconds: leaseSeconds(input.leaseSeconds),
			// The gateway caps the workflow name at 500 characters.
			workflow: optionalText(input.workflow)?.slice(0, 500),
			correlation_id: optionalText(input.correlationId),
		}),
	};
}

export interface DedupeInput {
	key: string;
	ttlSeconds: unknown;
	workflow?: string;
	correlationId?: string;
}

/** The gateway's longest dedupe TTL: a year. */
export const DEDUPE_MAX_TTL_SECONDS = 31_536_000;

/** Test-and-mark a key for a TTL in one call (`POST /v1/claims/dedupe`); no lease. */
export function dedupeRequest(credentials: IdemCredentials, input: DedupeInput): GatewayRequest {
	const ttl = Number(input.ttlSeconds);
	if (!Number.isInteger(ttl) || ttl < 1 || ttl > DEDUPE_MAX_TTL_SECONDS) {
		throw new IdemInputError(`TTL Seconds must be a whole number from 1 to ${DEDUPE_MAX_TTL_SECONDS}`);
	}
	return {
		method: 'POST',
		url: `${base(credentials)}/v1/claims/dedupe`,
		headers: claimsHeaders(credentials),
		body: jsonBody({
			key: required(input.key, 'Key'),
			ttl_seconds: ttl,
			workflow: optionalText(input.workflow)?.slice(0, 200),
			correlation_id: optionalText(input.correlationId),
		}),
	};
}

export type DedupeRoute = 'new' | 'seen';

/** 201 `{"seen": false}` → New; 200 `{"seen": true}` → Seen; anything else is a refusal. */
export function dedupeRoute(answer: GatewayAnswer): DedupeRoute | null {
	const body = parseBody(answer.body);
	if (answer.statusCode === 201 && body.seen === false) return 'new';
	if (answer.statusCode === 200 && body.seen === true) return 'seen';
	return null;
}

export interface CompleteInput {
	key: string;
	leaseToken: string;
	result?: Json;
	externalRef?: string;
}

export function completeRequest(credentials: IdemCredentials, input: CompleteInput): GatewayRequest {
	return {
		method: 'POST',
		url: claimPath(credentials, input.key, 'complete'),
		headers: claimsHeaders(credentials),
		body: jsonBody({
			lease_token: required(input.leaseToken, 'Lease token'),
			result: input.result,
			external_ref: optionalText(input.externalRef),
		}),
	};
}

export type Effect = 'unknown' | 'none';

export interface FailInput {
	key: string;
	leaseToken: string;
	errorCode: string;
	retryable: boolean;
	/** `none` only when nothing was done (the downstream refused, the request never left). */
	effect?: Effect;
	detail?: string;
}

export function failRequest(credentials: IdemCredentials, input: FailInput): GatewayRequest {
	const effect = input.effect ?? 'unknown';
	if (effect !== 'unknown' && effect !== 'none') {
		throw new IdemInputError(`Effect must be "unknown" or "none" (got "${String(effect)}")`);
	}
	const errorCode = required(input.errorCode, 'Error code');
	if (!/^[A-Za-z0-9_.:-]{1,100}$/.test(errorCode)) {
		throw new IdemInputError(`Error code may hold letters, digits and _ . : - only, 100 at most (got "${errorCode}")`);
	}
	return {
		method: 'POST',
		url: claimPath(credentials, input.key, 'fail'),
		headers: claimsHeaders(credentials),
		body: jsonBody({
			lease_token: required(input.leaseToken, 'Lease token'),
			error_code: errorCode,
			retryable: Boolean(input.retryable),
			effect,
			detail: input.detail ? String(input.detail).slice(0, 10_000) : undefined,
		}),
	};
}

export interface HeartbeatInput {
	key: string;
	leaseToken: string;
	leaseSeconds?: number | string;
}

export function heartbeatRequest(credentials: IdemCredentials, input: HeartbeatInput): GatewayRequest {
	return {
		method: 'POST',
		url: claimPath(credentials, input.key, 'heartbeat'),
		headers: claimsHeaders(credentials),
		body: jsonBody({
			lease_token: required(input.leaseToken, 'Lease token'),
			lease_seconds: leaseSeconds(input.leaseSeconds),
		}),
	};
}

/** `GET /v1/events/{key}` returns the stored result: it takes the claims or the operator token. */
export function getEventRequest(credentials: IdemCredentials, key: string): GatewayRequest {
	const headers: Record<string, string> = { Accept: 'application/json' };
	const token = credentials.claimsToken || credentials.operatorToken;
	if (token) headers.Authorization = `Bearer ${token}`;
	return {
		method: 'GET',
		url: `${base(credentials)}/v1/events/${encodeURIComponent(required(key, 'Key'))}`,
		headers,
	};
}

export interface SendEventInput {
	/** The envelope: source, event_type, external_id, payload, and the optional members. */
	envelope: Record<string, unknown>;
	idempotencyKey?: string;
}

/**
 * The gateway's `hmac` scheme, v2: HMAC-SHA256 over "<timestamp>.<idempotency key>.<body>",
 * the key empty when none is sent, so a captured request cannot come back under another key.
 */
export function signature(secret: string, timestamp: number, idempotencyKey: string, body: string): string {
	const digest = createHmac('sha256', secret).update(`${timestamp}.${idempotencyKey}.${body}`).digest('hex');
	return `v2=${digest}`;
}

export function sendEventRequest(
	credentials: IdemCredentials,
	input: SendEventInput,
	nowSeconds: number,
): GatewayRequest {
	const body = JSON.stringify(input.envelope);
	const headers: Record<string, string> = { 'Content-Type': 'application/json', Accept: 'application/json' };
	const key = optionalText(input.idempotencyKey);
	if (key) headers['Idempotency-Key'] = key;
	if (credentials.signingSecret) {
		const timestamp = Math.floor(nowSeconds);
		headers['X-Idem-Timestamp'] = String(timestamp);
		headers['X-Idem-Signature'] = signature(credentials.signingSecret, timestamp, key ?? '', body);
	}
	return { method: 'POST', url: `${base(credentials)}/v1/events`, headers, body };
}

/**
 * Send Event's payload when Event Payload is left empty: the webhook's body when the item
 * comes from a Webhook node (it has `body` and `headers`), never its headers, which carry
 * provider signatures and `Authorization` and change on every redelivery (the same key with
 * another payload is refused). Any other item is the payload itself, without the `idem` an
 * earlier Idem node put there (its lease token differs on every run).
 */
export function defaultEventPayload(itemJson: unknown): Json {
	if (!isMap(itemJson)) throw new IdemInputError('The incoming item is not a JSON object; set Event Payload');
	if ('body' in itemJson && isMap(itemJson.headers)) {
		if (!isMap(itemJson.body)) {
			throw new IdemInputError("The webhook's body is not a JSON object; set Event Payload");
		}
		return itemJson.body;
	}
	const payload: JsonMap = { ...itemJson };
	delete payload.idem;
	return payload;
}

/** The envelope from the node's fields; empty optional members are left out. */
export function envelopeFromFields(fields: {
	source: string;
	eventType: string;
	externalId: string | number;
	payload: Json | undefined;
	version?: string;
	correlationId?: string;
	workflow?: string;
	executionId?: string;
}): Record<string, unknown> {
	const payload = fields.payload ?? {};
	if (typeof payload !== 'object' || payload === null || Array.isArray(payload)) {
		throw new IdemInputError('Payload must be a JSON object');
	}
	const envelope: Record<string, unknown> = {
		source: required(fields.source, 'Source'),
		event_type: required(fields.eventType, 'Event type'),
		external_id: typeof fields.externalId === 'number' ? fields.externalId : required(fields.externalId, 'External ID'),
		payload,
	};
	const optional = {
		version: fields.version,
		correlation_id: fields.correlationId,
		workflow: fields.workflow,
		execution_id: fields.executionId,
	};
	for (const [name, value] of Object.entries(optional)) {
		const text = optionalText(value);
		if (text) envelope[name] = text;
	}
	return envelope;
}

// ------------------------------------------------------------------ answers

export function header(headers: Record<string, unknown>, name: string): string | undefined {
	const wanted = name.toLowerCase();
	for (const [key, value] of Object.entries(headers ?? {})) {
		if (key.toLowerCase() === wanted) {
			return Array.isArray(value) ? String(value[0]) : value === undefined ? undefined : String(value);
		}
	}
	return undefined;
}

/** The body as an object: JSON (problem+json included) parsed, anything else kept as text. */
export function parseBody(body: unknown): JsonMap {
	if (body === undefined || body === null || body === '') return {};
	if (typeof body === 'object' && !Array.isArray(body)) return body as JsonMap;
	const text = typeof body === 'string' ? body : Buffer.isBuffer(body) ? body.toString('utf8') : String(body);
	try {
		const value = JSON.parse(text) as Json;
		if (value && typeof value === 'object' && !Array.isArray(value)) return value;
		return { value };
	} catch {
		return { text: text.slice(0, 2000) };
	}
}

/** No conclusion possible: Retry On Fail may repeat the request. */
export function isUnavailable(statusCode: number): boolean {
	return statusCode === 408 || statusCode === 429 || statusCode >= 500;
}

/** What an answer was to, where that changes its meaning. */
export type AnswerTo = 'claim' | 'complete' | 'fail' | 'heartbeat' | 'getEvent' | 'sendEvent' | 'dedupe';

/**
 * The gateway said no: an answer that is neither a success nor an outcome (`lease_lost`,
 * `not_a_claim_key`, `idempotency_key_reused`, `unauthorized`, `invalid_signature` ...). A
 * claim's busy and dead 409s are outcomes (its own outputs), and so is Get Event's 404 (no
 * such key). Unavailable answers (408, 429, 5xx) are not refusals: nothing was concluded.
 */
export function isRefusal(answer: GatewayAnswer, to: AnswerTo): boolean {
	if (isUnavailable(answer.statusCode)) return false;
	if (to === 'claim') return claimRoute(answer) === 'refused';
	if (to === 'dedupe') return dedupeRoute(answer) === null;
	if (answer.statusCode < 300) return false;
	return !(to === 'getEvent' && answer.statusCode === 404);
}

/**
 * An event's states that will not change by themselves. `partially_failed` is a fan-out
 * event's: every delivery finished, some with the effect and some without (dead letters that
 * wait for an operator's replay).
 */
export const FINISHED_STATUSES: readonly string[] = [
	'succeeded',
	'failed_final',
	'quarantined',
	'superseded',
	'partially_failed',
];

/** A fan-out delivery's states that ended without the effect. */
const FAILED_DELIVERY_STATUSES: readonly string[] = ['failed_final', 'quarantined'];

/**
 * What the item carries under `idem`: the gateway's answer; `status`, always a state string
 * (the gateway's own, e.g. `claimed`, `succeeded`, `in_progress`, `pending`,
 * `partially_failed`; `refused` for a refusal; `not_found` for Get Event's 404);
 * `http_status`, the HTTP code; `replayed` when the answer was a replay; `retry_after` when
 * given; and `error` (the problem's code, else the answer's status, else `http_<code>`) when it
 * was not a success. An event's state (Get Event, Send Event) adds `finished`, whether it will
 * change by itself no more; a fan-out event's keeps its `deliveries` (each destination's own
 * state) and adds `failed_destinations`, the destinations whose delivery ended without the
 * effect (empty while none has).
 */
export function answerFields(answer: GatewayAnswer, to: AnswerTo = 'claim'): JsonMap {
	const body = parseBody(answer.body);
	const fields: JsonMap = { ...body, http_status: answer.statusCode };
	if (header(answer.headers, 'idempotent-replayed') === 'true') fields.replayed = true;
	const retryAfter = Number(header(answer.headers, 'retry-after'));
	if (Number.isFinite(retryAfter) && retryAfter > 0) fields.retry_after = retryAfter;
	if (answer.statusCode >= 300) {
		const code = typeof body.error === 'string' ? body.error : typeof body.status === 'string' ? body.status : null;
		fields.error = code ?? `http_${answer.statusCode}`;
	}
	if (isUnavailable(answer.statusCode)) {
		fields.status = 'unavailable';
	} else if (answer.statusCode === 404 && to === 'getEvent') {
		fields.status = 'not_found';
	} else if (isRefusal(answer, to)) {
		fields.status = 'refused';
	} else {
		fields.status = typeof body.status === 'string' ? body.status : 'ok';
	}
	if (to === 'dedupe' && !isRefusal(answer, to) && !isUnavailable(answer.statusCode)) {
		fields.status = body.seen === true ? 'seen' : 'new';
	}
	if ((to === 'getEvent' || to === 'sendEvent') && answer.statusCode < 300) {
		fields.finished = FINISHED_STATUSES.includes(String(fields.status));
		if (Array.isArray(body.deliveries)) {
			fields.failed_destinations = body.deliveries
				.filter((one) => isMap(one) && FAILED_DELIVERY_STATUSES.includes(String(one.status)))
				.map((one) => String((one as JsonMap).destination));
		}
	}
	return fields;
}

/** One line for a refusal, for the error n8n shows. */
export function refusalMessage(answer: GatewayAnswer, operation: string): string {
	const fields = answerFields(answer, 'complete');
	const detail = typeof fields.detail === 'string' ? `: ${fields.detail}` : '';
	return `The gateway refused ${operation} (HTTP ${answer.statusCode} ${String(fields.error)})${detail}`;
}

/**
 * Members of one answer that say nothing about the next one: not carried over (an event's
 * `deliveries` would otherwise be read as the next key's).
 */
const ANSWER_ONLY = [
	'error',
	'detail',
	'title',
	'type',
	'errors',
	'retry_after',
	'replayed',
	'outcome',
	'busy_rounds',
	'finished',
	'deliveries',
	'failed_destinations',
	'superseded_by',
];

function isMap(value: unknown): value is JsonMap {
	return typeof value === 'object' && value !== null && !Array.isArray(value);
}

/**
 * The item's `idem` after an operation: the new answer merged over what the item carried, so
 * the claim's `key` and `lease_token` travel on through Heartbeat, Get Event or Send Event to
 * Complete or Fail (a heartbeat's answer has no lease token). `claim` is the key and lease token
 * the operation itself used (Complete, Fail, Heartbeat); without it, a held claim's key stays
 * `key` and another key the answer names (an event's) goes under `event_key`.
 */
export function mergeIdem(previous: unknown, answer: JsonMap, claim?: { key?: string; leaseToken?: string }): JsonMap {
	const carried: JsonMap = isMap(previous) ? { ...previous } : {};
	for (const name of ANSWER_ONLY) delete carried[name];
	const merged: JsonMap = { ...carried, ...answer };
	if (claim) {
		if (claim.key) merged.key = claim.key;
		if (claim.leaseToken && typeof answer.lease_token !== 'string') merged.lease_token = claim.leaseToken;
		return merged;
	}
	const held = typeof carried.lease_token === 'string' && carried.lease_token !== '';
	if (held && typeof carried.key === 'string') {
		if (answer.key !== undefined && answer.key !== carried.key) merged.event_key = answer.key;
		merged.key = carried.key;
		if (typeof answer.lease_token !== 'string') merged.lease_token = carried.lease_token;
	}
	return merged;
}

/** One line for an unavailable answer, for the error n8n shows and retries on. */
export function unavailableMessage(answer: GatewayAnswer): string {
	const fields = answerFields(answer);
	const detail = typeof fields.detail === 'string' ? `: ${fields.detail}` : '';
	return `The gateway is unavailable (HTTP ${answer.statusCode} ${String(fields.error)})${detail}`;
}

// ------------------------------------------------------------------ claim outcomes

/** The Claim operation's outputs, in order. */
export const CLAIM_ROUTES = ['act', 'lookFirst', 'done', 'busy', 'dead', 'refused'] as const;
export type ClaimRoute = (typeof CLAIM_ROUTES)[number];

export const CLAIM_OUTPUT_NAMES: Record<ClaimRoute, string> = {
	act: 'Act',
	lookFirst: 'Look First',
	done: 'Done',
	busy: 'Busy',
	dead: 'Dead',
	refused: 'Refused',
};

/**
 * Where a claim's answer goes:
 *
 *   201 claimed, uncertain false      act: nothing was done before
 *   201 claimed, uncertain true       lookFirst: an earlier attempt may have acted
 *   200 already_succeeded             done: the stored result
 *   409 in_progress                   busy: someone holds a live lease (Retry-After)
 *   409 failed_final / quarantined    dead: an operator decides
 *   any other answer                  refused (`idem.error` says why)
 *
 * Unavailable answers never get here: the node throws on them.
 */
export function claimRoute(answer: GatewayAnswer): ClaimRoute {
	const body = parseBody(answer.body);
	const status = body.status;
	if (answer.statusCode === 201 && status === 'claimed') {
		return body.uncertain === true ? 'lookFirst' : 'act';
	}
	if (answer.statusCode === 200 && status === 'already_succeeded') return 'done';
	if (answer.statusCode === 409 && status === 'in_progress') return 'busy';
	if (answer.statusCode === 409 && (status === 'failed_final' || status === 'quarantined')) return 'dead';
	return 'refused';
}

export const BUSY_WAIT_DEFAULT_SECONDS = 2;

/**
 * Claim's Busy defaults: 2 rounds of at most 2 s (a smaller Retry-After honoured), so a
 * duplicate waits at most 4 s plus three short claims before it leaves on Done or Busy, inside
 * the ~5-10 s webhook timeout of many providers. The gateway's busy Retry-After is the live
 * lease's remaining time (up to Lease Seconds), not an estimate of the run, so it only caps.
 */
export const BUSY_DEFAULT_ROUNDS = 2;
export const BUSY_DEFAULT_MAX_WAIT_SECONDS = 2;

/**
 * Seconds to wait before claiming again while busy: the gateway's Retry-After (the live
 * lease's remaining time), at least 1 s, at most `capSeconds` so a long lease does not hold
 * the execution for minutes.
 */
export function busyWaitSeconds(answer: GatewayAnswer, capSeconds: number): number {
	const fromHeader = Number(header(answer.headers, 'retry-after'));
	const fromBody = Number(parseBody(answer.body).retry_after);
	const wanted = Number.isFinite(fromHeader) && fromHeader > 0
		? fromHeader
		: Number.isFinite(fromBody) && fromBody > 0
			? fromBody
			: BUSY_WAIT_DEFAULT_SECONDS;
	return Math.min(Math.max(wanted, 1), Math.max(capSeconds, 1));
}
