// Request building and answer routing of the gateway contract (dist/nodes/Idem/protocol.js):
// no n8n, no network. `npm test` builds first.
const test = require('node:test');
const assert = require('node:assert/strict');
const { createHmac } = require('node:crypto');

const protocol = require('../dist/nodes/Idem/protocol.js');

const CREDENTIALS = { baseUrl: 'http://idem.test:8000/', claimsToken: 'claims-secret' };

function answer(statusCode, body, headers = {}) {
	return { statusCode, headers, body: typeof body === 'string' ? body : JSON.stringify(body) };
}

// ------------------------------------------------------------------ requests

test('a claim posts key, payload, lease and workflow with the claims token', () => {
	const request = protocol.claimRequest(CREDENTIALS, {
		key: 'n8n:crm-follow-up:evt-1',
		payload: { event_id: 'evt-1' },
		leaseSeconds: 60,
		workflow: 'CRM follow-up',
	});
	assert.equal(request.method, 'POST');
	assert.equal(request.url, 'http://idem.test:8000/v1/claims');
	assert.equal(request.headers.Authorization, 'Bearer claims-secret');
	assert.equal(request.headers['Content-Type'], 'application/json');
	assert.deepEqual(JSON.parse(request.body), {
		key: 'n8n:crm-follow-up:evt-1',
		payload: { event_id: 'evt-1' },
		lease_seconds: 60,
		workflow: 'CRM follow-up',
	});
});

test('a claim leaves out empty optional members (the gateway forbids nulls it does not know)', () => {
	const request = protocol.claimRequest(CREDENTIALS, { key: 'k', leaseSeconds: '', correlationId: ' ' });
	assert.deepEqual(JSON.parse(request.body), { key: 'k' });
});

test('a claim without a token sends no Authorization header', () => {
	const request = protocol.claimRequest({ baseUrl: 'http://localhost:8000' }, { key: 'k' });
	assert.equal(request.headers.Authorization, undefined);
});

test('an empty key, a bad lease or a bad base URL is the user’s error, before any request', () => {
	assert.throws(() => protocol.claimRequest(CREDENTIALS, { key: '  ' }), protocol.IdemInputError);
	assert.throws(() => protocol.claimRequest(CREDENTIALS, { key: 'k', leaseSeconds: 0 }), /1 to 3600/);
	assert.throws(() => protocol.claimRequest(CREDENTIALS, { key: 'k', leaseSeconds: 1.5 }), /1 to 3600/);
	assert.throws(() => protocol.claimRequest({ baseUrl: 'idem:8000' }, { key: 'k' }), /Base URL/);
});

test('complete, fail and heartbeat put the key in the path, escaped, and the lease token in the body', () => {
	const key = 'n8n:crm follow-up/evt-1';
	const escaped = 'n8n%3Acrm%20follow-up%2Fevt-1';
	const complete = protocol.completeRequest(CREDENTIALS, {
		key,
		leaseToken: '7.abc',
		result: { task_id: 'T-1' },
		externalRef: 'T-1',
	});
	assert.equal(complete.url, `http://idem.test:8000/v1/claims/${escaped}/complete`);
	assert.deepEqual(JSON.parse(complete.body), { lease_token: '7.abc', result: { task_id: 'T-1' }, external_ref: 'T-1' });

	const fail = protocol.failRequest(CREDENTIALS, {
		key,
		leaseToken: '7.abc',
		errorCode: 'http_503',
		retryable: true,
		effect: 'none',
		detail: 'CRM refused',
	});
	assert.equal(fail.url, `http://idem.test:8000/v1/claims/${escaped}/fail`);
	assert.deepEqual(JSON.parse(fail.body), {
		lease_token: '7.abc',
		error_code: 'http_503',
		retryable: true,
		effect: 'none',
		detail: 'CRM refused',
	});

	const heartbeat = protocol.heartbeatRequest(CREDENTIALS, { key, leaseToken: '7.abc', leaseSeconds: 120 });
	assert.equal(heartbeat.url, `http://idem.test:8000/v1/claims/${escaped}/heartbeat`);
	assert.deepEqual(JSON.parse(heartbeat.body), { lease_token: '7.abc', lease_seconds: 120 });
	for (const request of [complete, fail, heartbeat]) {
		assert.equal(request.headers.Authorization, 'Bearer claims-secret');
	}
});

test('fail says the effect is unknown unless told it is none, and checks its error code', () => {
	const base = { key: 'k', leaseToken: 't', errorCode: 'transport_error', retryable: false };
	assert.equal(JSON.parse(protocol.failRequest(CREDENTIALS, base).body).effect, 'unknown');
	assert.equal(JSON.parse(protocol.failRequest(CREDENTIALS, base).body).retryable, false);
	assert.throws(() => protocol.failRequest(CREDENTIALS, { ...base, effect: 'maybe' }), /Effect/);
	assert.throws(() => protocol.failRequest(CREDENTIALS, { ...base, errorCode: 'has space' }), /Error code/);
	assert.throws(() => protocol.failRequest(CREDENTIALS, { ...base, leaseToken: '' }), /Lease token/);
});

test('get event uses the claims token, else the operator token', () => {
	const withClaims = protocol.getEventRequest({ ...CREDENTIALS, operatorToken: 'op' }, 'a:b');
	assert.equal(withClaims.method, 'GET');
	assert.equal(withClaims.url, 'http://idem.test:8000/v1/events/a%3Ab');
	assert.equal(withClaims.headers.Authorization, 'Bearer claims-secret');
	assert.equal(withClaims.body, undefined);
	const operatorOnly = protocol.getEventRequest({ baseUrl: 'http://idem.test', operatorToken: 'op' }, 'k');
	assert.equal(operatorOnly.headers.Authorization, 'Bearer op');
});

test('send event signs timestamp, idempotency key and the exact body sent (v2)', () => {
	const secret = 'whsec_test';
	const envelope = { source: 'webform', event_type: 'crm.lead.created', external_id: 'evt-1', payload: { a: 1 } };
	const request = protocol.sendEventRequest(
		{ baseUrl: 'http://idem.test', signingSecret: secret },
		{ envelope, idempotencyKey: 'webform:evt-1' },
		1_700_000_000.7,
	);
	assert.equal(request.url, 'http://idem.test/v1/events');
	assert.equal(request.headers['Idempotency-Key'], 'webform:evt-1');
	assert.equal(request.headers['X-Idem-Timestamp'], '1700000000');
	const expected = createHmac('sha256', secret).update(`1700000000.webform:evt-1.${request.body}`).digest('hex');
	assert.equal(request.headers['X-Idem-Signature'], `v2=${expected}`);
	assert.deepEqual(JSON.parse(request.body), envelope);
	assert.equal(request.headers.Authorization, undefined, 'events are signed, not sent with a token');
});

test('send event without a key signs the empty key; without a secret it is unsigned', () => {
	const envelope = { source: 's', event_type: 't', external_id: '1', payload: {} };
	const signed = protocol.sendEventRequest({ baseUrl: 'http://x', signingSecret: 'k' }, { envelope }, 5);
	assert.equal(signed.headers['Idempotency-Key'], undefined);
	assert.equal(signed.headers['X-Idem-Signature'], protocol.signature('k', 5, '', signed.body));
	const unsigned = protocol.sendEventRequest({ baseUrl: 'http://x' }, { envelope, idempotencyKey: 'a' }, 5);
	assert.equal(unsigned.headers['X-Idem-Signature'], undefined);
	assert.equal(unsigned.headers['X-Idem-Timestamp'], undefined);
});

test('the envelope from fields keeps required members and drops empty optional ones', () => {
	const envelope = protocol.envelopeFromFields({
		source: 'webform',
		eventType: 'crm.lead.created',
		externalId: 'form-8812',
		payload: { email: 'ada@example.com' },
		version: '',
		workflow: 'wf',
		executionId: '42',
	});
	assert.deepEqual(envelope, {
		source: 'webform',
		event_type: 'crm.lead.created',
		external_id: 'form-8812',
		payload: { email: 'ada@example.com' },
		workflow: 'wf',
		execution_id: '42',
	});
	assert.throws(() => protocol.envelopeFromFields({ source: 's', eventType: 't', externalId: '1', payload: [1] }), /object/);
	assert.throws(() => protocol.envelopeFromFields({ source: '', eventType: 't', externalId: '1' }), /Source/);
});

test('JSON parameters arrive as objects or as typed text', () => {
	assert.deepEqual(protocol.jsonParameter('{"a": 1}', 'Payload'), { a: 1 });
	assert.deepEqual(protocol.jsonParameter({ a: 1 }, 'Payload'), { a: 1 });
	assert.equal(protocol.jsonParameter('', 'Payload'), undefined);
	assert.throws(() => protocol.jsonParameter('{a', 'Payload'), /Payload is not valid JSON/);
});

// ------------------------------------------------------------------ answers

test('claim answers go to one output per outcome', () => {
	const table = [
		[answer(201, { status: 'claimed', uncertain: false, lease_token: 't' }), 'act'],
		[answer(201, { status: 'claimed', uncertain: true, reclaimed: true, lease_token: 't' }), 'lookFirst'],
		[answer(200, { status: 'already_succeeded', result: { task_id: 'T-1' } }), 'done'],
		[answer(409, { status: 'in_progress', retry_after: 3 }, { 'retry-after': '3' }), 'busy'],
		[answer(409, { status: 'failed_final', error_code: 'crm_http_422' }), 'dead'],
		[answer(409, { status: 'quarantined', error_code: null }), 'dead'],
		[answer(409, { type: 'urn:idem:error:not_a_claim_key', error: 'not_a_claim_key', status: 409 }), 'refused'],
		[answer(422, { error: 'idempotency_key_reused', status: 422 }), 'refused'],
		[answer(401, { error: 'unauthorized', status: 401 }), 'refused'],
		[answer(200, 'not json'), 'refused'],
		// A claimed answer must be a 201 and say so: anything else is not a licence to act.
		[answer(200, { status: 'claimed' }), 'refused'],
	];
	for (const [given, route] of table) {
		assert.equal(protocol.claimRoute(given), route, JSON.stringify(given));
	}
	assert.deepEqual(Object.keys(protocol.CLAIM_OUTPUT_NAMES), [...protocol.CLAIM_ROUTES]);
	assert.deepEqual(Object.values(protocol.CLAIM_OUTPUT_NAMES), ['Act', 'Look First', 'Done', 'Busy', 'Dead', 'Refused']);
});

test('no answer worth acting on: 408, 429 and 5xx are unavailable, other answers are not', () => {
	for (const code of [408, 429, 500, 502, 503, 504]) assert.equal(protocol.isUnavailable(code), true, code);
	for (const code of [200, 201, 400, 401, 404, 409, 413, 422]) assert.equal(protocol.isUnavailable(code), false, code);
});

test('a problem+json answer puts its error code, detail and HTTP status on the item', () => {
	const problem = {
		type: 'urn:idem:error:idempotency_key_reused',
		title: 'This key was used with a different payload',
		status: 422,
		detail: 'This key was first claimed with a different payload.',
		error: 'idempotency_key_reused',
		key: 'k',
	};
	const fields = protocol.answerFields(answer(422, problem, { 'content-type': 'application/problem+json' }));
	assert.equal(fields.error, 'idempotency_key_reused');
	assert.equal(fields.status, 'refused', 'status is a state string, never the problem’s number');
	assert.equal(fields.http_status, 422);
	assert.equal(fields.detail, problem.detail);
});

test('a 409 without a problem document uses its status as the error (lease_lost)', () => {
	const fields = protocol.answerFields(answer(409, { status: 'lease_lost', key: 'k' }), 'complete');
	assert.equal(fields.error, 'lease_lost');
	assert.equal(fields.status, 'refused');
	assert.equal(fields.http_status, 409);
	assert.equal(protocol.answerFields(answer(404, '')).error, 'http_404');
});

test('a success carries no error, and a replay says so', () => {
	const fields = protocol.answerFields(
		answer(200, { status: 'already_succeeded', external_ref: 'T-1' }, { 'Idempotent-Replayed': 'true' }),
	);
	assert.equal(fields.error, undefined);
	assert.equal(fields.replayed, true);
	assert.equal(fields.external_ref, 'T-1');
});

test('an unavailable answer reads as one line with its code and detail', () => {
	const message = protocol.unavailableMessage(
		answer(503, { error: 'database_unavailable', detail: 'Nothing was stored.' }, { 'Retry-After': '5' }),
	);
	assert.equal(message, 'The gateway is unavailable (HTTP 503 database_unavailable): Nothing was stored.');
	assert.match(protocol.unavailableMessage(answer(502, '<html>bad gateway</html>')), /HTTP 502 http_502/);
});

test('busy waits honour Retry-After, at least 1 s and at most the cap', () => {
	const busy = (headers, body = { status: 'in_progress' }) => answer(409, body, headers);
	assert.equal(protocol.busyWaitSeconds(busy({ 'retry-after': '4' }), 30), 4);
	assert.equal(protocol.busyWaitSeconds(busy({ 'Retry-After': '600' }), 30), 30);
	assert.equal(protocol.busyWaitSeconds(busy({ 'retry-after': '0' }, { status: 'in_progress', retry_after: 7 }), 30), 7);
	assert.equal(protocol.busyWaitSeconds(busy({}), 30), protocol.BUSY_WAIT_DEFAULT_SECONDS);
	assert.equal(protocol.busyWaitSeconds(busy({ 'retry-after': 'soon' }), 1), 1);
});

test('mergeIdem keeps the claim’s key and lease token under later answers', () => {
	const claimed = { key: 'k', lease_token: '3.abc', status: 'claimed', outcome: 'act', uncertain: false };
	const beat = protocol.mergeIdem(claimed, { status: 'claimed', key: 'k', locked_until: 'T' }, { key: 'k', leaseToken: '3.abc' });
	assert.equal(beat.lease_token, '3.abc');
	assert.equal(beat.locked_until, 'T');
	assert.equal(beat.outcome, undefined);
	// Parameters set by hand win over the item's.
	const manual = protocol.mergeIdem({}, { status: 'succeeded' }, { key: 'other', leaseToken: '5.x' });
	assert.deepEqual(manual, { status: 'succeeded', key: 'other', lease_token: '5.x' });
	// An answer about another key (an event) does not take the claim's place.
	const sent = protocol.mergeIdem(claimed, { key: 'src:1', status: 'pending', duplicate: false });
	assert.equal(sent.key, 'k');
	assert.equal(sent.event_key, 'src:1');
	assert.equal(sent.lease_token, '3.abc');
	// Without a held claim the answer's key is the key.
	assert.equal(protocol.mergeIdem(undefined, { key: 'src:1' }).key, 'src:1');
	assert.equal(protocol.mergeIdem('not an object', { key: 'src:1' }).event_key, undefined);
});

test('refusals: per operation, and never a claim outcome', () => {
	const reused = answer(422, { error: 'idempotency_key_reused', status: 422 });
	const busy = answer(409, { status: 'in_progress' });
	const lost = answer(409, { status: 'lease_lost' });
	const missing = answer(404, { error: 'key_not_found', status: 404 });
	for (const to of ['claim', 'complete', 'fail', 'heartbeat', 'getEvent', 'sendEvent']) {
		assert.equal(protocol.isRefusal(reused, to), true, to);
		assert.equal(protocol.isRefusal(answer(503, {}), to), false, to);
		assert.equal(protocol.isRefusal(answer(200, { status: 'x' }), to), to === 'claim', to);
	}
	assert.equal(protocol.isRefusal(busy, 'claim'), false);
	assert.equal(protocol.isRefusal(lost, 'claim'), true);
	assert.equal(protocol.isRefusal(lost, 'complete'), true);
	assert.equal(protocol.isRefusal(missing, 'getEvent'), false);
	assert.equal(protocol.answerFields(missing, 'getEvent').status, 'not_found');
	assert.equal(protocol.isRefusal(missing, 'complete'), true);
	assert.equal(protocol.answerFields(answer(202, { status: 'pending' }), 'sendEvent').status, 'pending');
	assert.equal(protocol.answerFields(answer(200, {}), 'heartbeat').status, 'ok');
	assert.equal(protocol.answerFields(answer(503, { status: 503, error: 'database_unavailable' })).status, 'unavailable');
	assert.equal(
		protocol.refusalMessage(answer(409, { status: 'lease_lost', detail: 'gone' }), 'Complete'),
		'The gateway refused Complete (HTTP 409 lease_lost): gone',
	);
});

// A fan-out event's state as `GET /v1/events/{key}` (and a duplicate's answer) gives it.
function fanOut(status, deliveries) {
	return {
		key: 'stripe:webhook:ab12',
		status,
		deliveries: Object.entries(deliveries).map(([destination, state]) => ({
			destination,
			key: `stripe:webhook:ab12 @${destination}`,
			status: state,
			error_code: state === 'failed_final' ? 'http_422' : null,
		})),
	};
}

test('a fan-out event: partially_failed is finished, the failed destinations named, deliveries kept', () => {
	const partial = fanOut('partially_failed', { crm: 'succeeded', 'finance-flow': 'failed_final', slack: 'succeeded' });
	for (const to of ['getEvent', 'sendEvent']) {
		const fields = protocol.answerFields(answer(200, partial), to);
		assert.equal(protocol.isRefusal(answer(200, partial), to), false, to);
		assert.equal(fields.status, 'partially_failed', to);
		assert.equal(fields.finished, true, to);
		assert.deepEqual(fields.failed_destinations, ['finance-flow'], to);
		assert.deepEqual(fields.deliveries, partial.deliveries, to);
	}
	const running = protocol.answerFields(answer(200, fanOut('processing', { crm: 'succeeded', slack: 'pending' })), 'getEvent');
	assert.equal(running.finished, false);
	assert.deepEqual(running.failed_destinations, []);
	const accepted = protocol.answerFields(answer(202, fanOut('pending', { crm: 'pending' })), 'sendEvent');
	assert.equal(accepted.finished, false);
	const quarantined = protocol.answerFields(answer(200, fanOut('failed_final', { crm: 'quarantined', slack: 'failed_final' })), 'getEvent');
	assert.deepEqual([quarantined.finished, quarantined.failed_destinations], [true, ['crm', 'slack']]);
	// Every state that no longer changes by itself, and none of the others.
	for (const status of ['succeeded', 'failed_final', 'quarantined', 'superseded', 'partially_failed']) {
		assert.equal(protocol.answerFields(answer(200, { status }), 'getEvent').finished, true, status);
	}
	for (const status of ['pending', 'processing', 'failed_retryable']) {
		assert.equal(protocol.answerFields(answer(200, { status }), 'getEvent').finished, false, status);
	}
	// A key that acts itself has no deliveries; claims answers carry no `finished`.
	assert.equal('failed_destinations' in protocol.answerFields(answer(200, { status: 'succeeded' }), 'getEvent'), false);
	assert.equal('finished' in protocol.answerFields(answer(404, { error: 'key_not_found' }), 'getEvent'), false);
	assert.equal('finished' in protocol.answerFields(answer(200, { status: 'succeeded' }), 'complete'), false);
});

test('an event’s deliveries are not carried onto the next answer', () => {
	const looked = protocol.mergeIdem(
		{ key: 'claim-key', lease_token: '9.zz' },
		protocol.answerFields(answer(200, fanOut('partially_failed', { crm: 'succeeded', slack: 'failed_final' })), 'getEvent'),
	);
	assert.equal(looked.deliveries.length, 2);
	const next = protocol.mergeIdem(looked, protocol.answerFields(answer(200, { key: 'other', status: 'succeeded' }), 'getEvent'));
	for (const name of ['deliveries', 'failed_destinations', 'superseded_by']) assert.equal(name in next, false, name);
	assert.equal(next.finished, true);
	const completed = protocol.mergeIdem(looked, { status: 'succeeded' }, { key: 'claim-key', leaseToken: '9.zz' });
	assert.equal('finished' in completed, false, 'an earlier Get Event’s `finished` says nothing about the claim');
});

test('Send Event’s default payload is a Webhook item’s body, never its headers', () => {
	const body = { id: 'evt-1', data: { email: 'ada@example.com' } };
	const first = { headers: { 'x-signature': 't=1,v1=aa', authorization: 'Bearer a' }, params: {}, query: {}, body, webhookUrl: 'u' };
	const redelivery = { ...first, headers: { 'x-signature': 't=9,v1=bb', 'x-delivery-attempt': '2' } };
	assert.deepEqual(protocol.defaultEventPayload(first), body);
	assert.deepEqual(protocol.defaultEventPayload(redelivery), protocol.defaultEventPayload(first));
	// Any other item is the payload, without an earlier Idem node's `idem`.
	assert.deepEqual(protocol.defaultEventPayload({ email: 'a', idem: { lease_token: 't' } }), { email: 'a' });
	// `body` alone is an ordinary field.
	assert.deepEqual(protocol.defaultEventPayload({ body: 'text' }), { body: 'text' });
	assert.throws(() => protocol.defaultEventPayload({ body: 'raw', headers: {} }), /body is not a JSON object/);
	assert.throws(() => protocol.defaultEventPayload([1]), protocol.IdemInputError);
});

test('busy defaults: a smaller Retry-After is honoured, a lease-long one is cut to 2 s', () => {
	const busy = (retryAfter) => answer(409, { status: 'in_progress' }, { 'retry-after': String(retryAfter) });
	const cap = protocol.BUSY_DEFAULT_MAX_WAIT_SECONDS;
	assert.equal(protocol.busyWaitSeconds(busy(60), cap), 2);
	assert.equal(protocol.busyWaitSeconds(busy(1), cap), 1);
	assert.ok(protocol.BUSY_DEFAULT_ROUNDS * cap <= 6);
});
