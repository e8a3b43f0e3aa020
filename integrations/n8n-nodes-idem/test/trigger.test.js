// The Idem Trigger's pure parts (dist/nodes/IdemTrigger/trigger.js): the Standard Webhooks
// signature, the claim key, and the answer to the gateway for each claims outcome.
const test = require('node:test');
const assert = require('node:assert/strict');
const { createHash } = require('node:crypto');

const trigger = require('../dist/nodes/IdemTrigger/trigger.js');

// The Standard Webhooks specification's example.
const SECRET = 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw';
const ID = 'msg_p5jXN8AQM9LWM0D4loKWxJek';
const TIMESTAMP = '1614265330';
const BODY = '{"test": 2432232314}';
const SIGNATURE = 'v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=';

function answer(statusCode, body, headers = {}) {
	return { statusCode, headers, body: JSON.stringify(body) };
}

function delivery(overrides = {}) {
	return { id: ID, timestamp: TIMESTAMP, signature: SIGNATURE, body: Buffer.from(BODY), ...overrides };
}

// ------------------------------------------------------------------ signature

test('the signature is the Standard Webhooks example vector', () => {
	assert.equal(trigger.standardSignature(SECRET, ID, TIMESTAMP, BODY), SIGNATURE);
	assert.equal(trigger.standardSignature(SECRET, ID, Number(TIMESTAMP), Buffer.from(BODY)), SIGNATURE);
});

test('the example delivery verifies at its own time', () => {
	assert.deepEqual(trigger.verifyDelivery([SECRET], delivery(), Number(TIMESTAMP)), { ok: true });
});

test('one of several signatures, under one of several secrets, is enough (a rotation)', () => {
	const other = 'whsec_' + Buffer.alloc(32, 7).toString('base64');
	const verdict = trigger.verifyDelivery(
		[other, SECRET],
		delivery({ signature: `v1,${Buffer.alloc(32).toString('base64')} ${SIGNATURE}` }),
		Number(TIMESTAMP),
	);
	assert.deepEqual(verdict, { ok: true });
	assert.deepEqual(trigger.splitSecrets(` ${other},${SECRET}\n`), [other, SECRET]);
});

test('a changed body, id or timestamp, another secret, or a missing header is refused', () => {
	const now = Number(TIMESTAMP);
	const refused = [
		delivery({ body: Buffer.from('{"test": 2432232315}') }),
		delivery({ body: Buffer.from('{"test":2432232314}') }), // the same JSON, other bytes
		delivery({ id: 'msg_other' }),
		delivery({ timestamp: '1614265331' }),
		delivery({ signature: 'v1,AAAA' }),
		delivery({ signature: SIGNATURE.replace('v1,', 'v2,') }),
		delivery({ signature: undefined }),
		delivery({ id: undefined }),
		delivery({ timestamp: undefined }),
		delivery({ timestamp: 'yesterday' }),
	];
	for (const one of refused) {
		assert.equal(trigger.verifyDelivery([SECRET], one, now).ok, false, JSON.stringify({ ...one, body: String(one.body) }));
	}
	const otherSecret = 'whsec_' + Buffer.alloc(32, 1).toString('base64');
	assert.equal(trigger.verifyDelivery([otherSecret], delivery(), now).ok, false);
	assert.equal(trigger.verifyDelivery([], delivery(), now).ok, false);
});

test('a timestamp further than 5 minutes from now is refused (a replay)', () => {
	const signedAt = Number(TIMESTAMP);
	assert.equal(trigger.verifyDelivery([SECRET], delivery(), signedAt + 300).ok, true);
	assert.equal(trigger.verifyDelivery([SECRET], delivery(), signedAt + 301).ok, false);
	assert.equal(trigger.verifyDelivery([SECRET], delivery(), signedAt - 301).ok, false);
});

test('a secret that is not base64 is an error, not a match', () => {
	assert.throws(() => trigger.decodeSecret('whsec_not base64!'), /whsec_/);
	assert.deepEqual(trigger.decodeSecret('MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw'), trigger.decodeSecret(SECRET));
});

// ------------------------------------------------------------------ claim key

test('the claim key is the gateway key under the trigger prefix, hashed when too long', () => {
	assert.equal(trigger.claimKeyFor('webform:evt-1'), 'n8n-trigger:webform:evt-1');
	const long = trigger.claimKeyFor('k'.repeat(250));
	assert.match(long, /^n8n-trigger:sha256:[0-9a-f]{64}$/);
	assert.equal(trigger.claimKeyFor('k'.repeat(250)), long);
});

test('a key that starts like a hashed one is hashed too, so two keys never share a claim', () => {
	// A source named `sha256` sending `Idempotency-Key: <hex>` has the gateway key
	// `sha256:<hex>`; written as it is, its claim would be the hashed claim of a long key.
	const longKey = 'k'.repeat(250);
	const hex = createHash('sha256').update(longKey, 'utf8').digest('hex');
	const squatting = trigger.claimKeyFor(`sha256:${hex}`);
	assert.notEqual(squatting, trigger.claimKeyFor(longKey));
	assert.match(squatting, /^n8n-trigger:sha256:[0-9a-f]{64}$/);
	// Claims already held keep their key: a plain key and a long key's hash are unchanged.
	assert.equal(trigger.claimKeyFor('webform:evt-1'), 'n8n-trigger:webform:evt-1');
	assert.equal(trigger.claimKeyFor(longKey), `n8n-trigger:sha256:${hex}`);
});

// ------------------------------------------------------------------ claims outcomes

test('claimed starts the execution with the lease token', () => {
	const action = trigger.triggerAction(
		answer(201, { status: 'claimed', lease_token: 'lt-1', attempt: 1, uncertain: false, correlation_id: 'c-1' }),
	);
	assert.equal(action.start, true);
	assert.equal(action.idem.status, 'claimed');
	assert.equal(action.idem.lease_token, 'lt-1');
});

test('claimed after an earlier run that may have acted starts it marked uncertain', () => {
	const action = trigger.triggerAction(
		answer(201, { status: 'claimed', lease_token: 'lt-2', attempt: 2, uncertain: true, reclaimed: true }),
	);
	assert.equal(action.start, true);
	const item = trigger.triggerItem({
		event: { id: 'evt-1' },
		gatewayKey: 'webform:evt-1',
		claimKey: 'n8n-trigger:webform:evt-1',
		claim: action.idem,
		correlationId: 'corr-1',
	});
	assert.deepEqual(item.event, { id: 'evt-1' });
	assert.equal(item.key, 'webform:evt-1');
	assert.equal(item.attempt, 2);
	assert.equal(item.uncertain, true);
	assert.equal(item.correlation_id, 'corr-1');
	// Where the Idem node's Complete, Fail and Heartbeat look by default.
	assert.equal(item.idem.key, 'n8n-trigger:webform:evt-1');
	assert.equal(item.idem.lease_token, 'lt-2');
	assert.equal(item.idem.gateway_key, 'webform:evt-1');
});

test('in progress answers the gateway 409 idem in_progress with the claims estimate', () => {
	const action = trigger.triggerAction(answer(409, { status: 'in_progress', retry_after: 4 }, { 'retry-after': '4' }));
	assert.equal(action.start, false);
	assert.equal(action.reply.statusCode, 409);
	assert.deepEqual(action.reply.body, { idem: 'in_progress', retry_after: 4 });
	assert.equal(action.reply.headers['Retry-After'], '4');
	// No estimate: a default; a header only: the header.
	assert.equal(trigger.triggerAction(answer(409, { status: 'in_progress' })).reply.body.retry_after, 5);
	assert.equal(
		trigger.triggerAction(answer(409, { status: 'in_progress' }, { 'Retry-After': '7' })).reply.body.retry_after,
		7,
	);
});

test('already succeeded answers 200 with the stored result and starts nothing', () => {
	const action = trigger.triggerAction(
		answer(200, { status: 'already_succeeded', result: { task_id: 't-1' }, external_ref: 't-1' }),
	);
	assert.equal(action.start, false);
	assert.equal(action.reply.statusCode, 200);
	assert.deepEqual(action.reply.body, { task_id: 't-1' });
	assert.equal(action.reply.headers['Idempotent-Replayed'], 'true');
	const scalar = trigger.triggerAction(answer(200, { status: 'already_succeeded', result: 'done' }));
	assert.deepEqual(scalar.reply.body, { result: 'done' });
});

test('a dead key is a plain 409 (permanent for the gateway)', () => {
	const action = trigger.triggerAction(answer(409, { status: 'failed_final', error_code: 'http_422' }));
	assert.equal(action.start, false);
	assert.equal(action.reply.statusCode, 409);
	assert.deepEqual(action.reply.body, { idem: 'failed_final', error_code: 'http_422' });
	assert.notEqual(action.reply.body.idem, 'in_progress');
});

test('no answer or an unavailable claims API answers 503 so the gateway retries', () => {
	for (const one of [undefined, answer(503, { error: 'db_down' }), answer(429, {}), answer(408, {})]) {
		const action = trigger.triggerAction(one);
		assert.equal(action.start, false);
		assert.equal(action.reply.statusCode, 503);
		assert.equal(action.reply.headers['Retry-After'], '5');
	}
});

test('a refusal (wrong claims token, changed payload) answers 502 and starts nothing', () => {
	const token = trigger.triggerAction(answer(401, { error: 'unauthorized' }));
	assert.equal(token.start, false);
	assert.equal(token.reply.statusCode, 502);
	assert.equal(token.reply.body.error, 'unauthorized');
	const reused = trigger.triggerAction(answer(422, { error: 'idempotency_key_reused' }));
	assert.equal(reused.reply.body.error, 'idempotency_key_reused');
	assert.equal(trigger.triggerAction(answer(409, { error: 'not_a_claim_key' })).reply.statusCode, 502);
});

// ------------------------------------------------------------------ the node with a fake n8n

const { IdemTrigger } = require('../dist/nodes/IdemTrigger/IdemTrigger.node.js');
const packageJson = require('../package.json');

const GATEWAY_SECRET = 'whsec_' + Buffer.from('an-e2e-delivery-secret-32-bytes!').toString('base64');

/**
 * A webhook call as n8n hands it to the node; `claims` answers the claim request (a function:
 * each request by its URL). The response object is Express's as far as n8n and the node use it.
 */
function webhookCall({ headers, body, claims }) {
	const sent = { claims: [], reply: null, headers: {} };
	const response = {
		statusCode: 200,
		headersSent: false,
		setHeader: (name, value) => (sent.headers[name] = value),
		status(code) {
			response.statusCode = code;
			return response;
		},
		json(json) {
			sent.reply = { code: response.statusCode, json };
			response.headersSent = true;
			return response;
		},
		send(text) {
			return response.json(text);
		},
	};
	const context = {
		getCredentials: async () => ({
			baseUrl: 'http://idem.test:8000',
			claimsToken: 'claims-secret',
			deliverySigningSecret: GATEWAY_SECRET,
		}),
		getRequestObject: () => ({ rawBody: Buffer.from(body) }),
		getHeaderData: () => headers,
		getBodyData: () => JSON.parse(body),
		getNodeParameter: (_name, fallback) => fallback,
		getWorkflow: () => ({ name: 'trigger test' }),
		getResponseObject: () => response,
		helpers: {
			httpRequest: async (request) => {
				sent.claims.push(request);
				return typeof claims === 'function' ? claims(request.url) : claims;
			},
		},
	};
	return { context, sent };
}

function signedHeaders(id, body, secret = GATEWAY_SECRET) {
	const timestamp = String(Math.floor(Date.now() / 1000));
	return {
		'webhook-id': id,
		'webhook-timestamp': timestamp,
		'webhook-signature': trigger.standardSignature(secret, id, timestamp, body),
		'x-correlation-id': 'corr-9',
	};
}

test('the trigger is registered, a POST webhook answered when the last node finishes', () => {
	assert.ok(packageJson.n8n.nodes.includes('dist/nodes/IdemTrigger/IdemTrigger.node.js'));
	const description = new IdemTrigger().description;
	assert.equal(description.name, 'idemTrigger');
	assert.deepEqual(description.inputs, []);
	assert.equal(description.webhooks[0].httpMethod, 'POST');
	assert.equal(description.webhooks[0].responseMode, 'lastNode');
	assert.equal(description.webhooks[0].responseData, 'firstEntryJson');
	assert.equal(description.webhooks[0].isFullPath, true);
});

test('a bad signature is answered 401 and neither claims nor starts anything', async () => {
	const body = '{"id":"evt-1"}';
	const headers = signedHeaders('webform:evt-1', body, 'whsec_' + Buffer.alloc(32, 3).toString('base64'));
	const { context, sent } = webhookCall({ headers, body, claims: null });
	const result = await new IdemTrigger().webhook.call(context);
	assert.deepEqual(result, { noWebhookResponse: true });
	assert.equal(sent.reply.code, 401);
	assert.equal(sent.claims.length, 0);
});

test('a signed first delivery claims the prefixed key and starts one execution', async () => {
	const body = '{"id":"evt-1","data":{"email":"a@b.c"}}';
	const claims = {
		statusCode: 201,
		headers: {},
		body: JSON.stringify({ status: 'claimed', lease_token: 'lt-1', attempt: 1, uncertain: false }),
	};
	const { context, sent } = webhookCall({ headers: signedHeaders('webform:evt-1', body), body, claims });
	const result = await new IdemTrigger().webhook.call(context);
	assert.equal(sent.reply, null);
	const claim = sent.claims[0];
	assert.equal(claim.url, 'http://idem.test:8000/v1/claims');
	assert.equal(claim.headers.Authorization, 'Bearer claims-secret');
	assert.deepEqual(JSON.parse(claim.body), {
		key: 'n8n-trigger:webform:evt-1',
		payload: { id: 'evt-1', data: { email: 'a@b.c' } },
		lease_seconds: 300,
		workflow: 'trigger test',
		correlation_id: 'corr-9',
	});
	const item = result.workflowData[0][0].json;
	assert.deepEqual(item.event, { id: 'evt-1', data: { email: 'a@b.c' } });
	assert.equal(item.key, 'webform:evt-1');
	assert.equal(item.correlation_id, 'corr-9');
	assert.equal(item.idem.lease_token, 'lt-1');
	assert.equal(item.idem.key, 'n8n-trigger:webform:evt-1');
});

test('a re-send while the execution runs is answered 409 in_progress and starts nothing', async () => {
	const body = '{"id":"evt-1"}';
	const claims = { statusCode: 409, headers: { 'retry-after': '3' }, body: JSON.stringify({ status: 'in_progress', retry_after: 3 }) };
	const { context, sent } = webhookCall({ headers: signedHeaders('webform:evt-1', body), body, claims });
	const result = await new IdemTrigger().webhook.call(context);
	assert.deepEqual(result, { noWebhookResponse: true });
	assert.equal(sent.reply.code, 409);
	assert.deepEqual(sent.reply.json, { idem: 'in_progress', retry_after: 3 });
	assert.equal(sent.headers['Retry-After'], '3');
});

/** Lets the trigger's asynchronous answer after the run go out. */
async function settle() {
	for (let round = 0; round < 5; round++) await new Promise((resolve) => setImmediate(resolve));
}

test('when n8n answers the last node’s item, the trigger completes the claim and answers the clean result', async () => {
	const body = '{"id":"evt-2"}';
	const claims = (url) =>
		url.endsWith('/complete')
			? { statusCode: 200, headers: {}, body: JSON.stringify({ status: 'succeeded', key: 'n8n-trigger:webform:evt-2' }) }
			: { statusCode: 201, headers: {}, body: JSON.stringify({ status: 'claimed', lease_token: '3.lt', uncertain: false }) };
	const { context, sent } = webhookCall({ headers: signedHeaders('webform:evt-2', body), body, claims });
	const result = await new IdemTrigger().webhook.call(context);
	assert.equal(result.workflowData[0].length, 1, 'Act');
	assert.equal(result.workflowData[1].length, 0, 'Look First');
	// n8n, once the last node (an HTTP Request: the CRM's answer) has run:
	const response = context.getResponseObject();
	response.status(200);
	response.json({ id: 'task-9', idem: { lease_token: '3.lt' } });
	await settle();
	assert.deepEqual(sent.reply, { code: 200, json: { id: 'task-9' } });
	const complete = sent.claims[1];
	assert.equal(complete.url, 'http://idem.test:8000/v1/claims/n8n-trigger%3Awebform%3Aevt-2/complete');
	assert.deepEqual(JSON.parse(complete.body), { lease_token: '3.lt', result: { id: 'task-9' } });
});

test('when the workflow fails, the trigger frees the claim and answers a classified failure', async () => {
	const body = '{"id":"evt-3"}';
	const claims = (url) =>
		url.endsWith('/fail')
			? { statusCode: 200, headers: {}, body: JSON.stringify({ status: 'failed_retryable' }) }
			: { statusCode: 201, headers: {}, body: JSON.stringify({ status: 'claimed', lease_token: '4.lt', uncertain: true }) };
	const { context, sent } = webhookCall({ headers: signedHeaders('webform:evt-3', body), body, claims });
	const result = await new IdemTrigger().webhook.call(context);
	assert.equal(result.workflowData[0].length, 0, 'Act');
	assert.equal(result.workflowData[1][0].json.uncertain, true, 'Look First');
	const response = context.getResponseObject();
	response.status(500);
	response.json({ message: 'Error in workflow' });
	await settle();
	assert.equal(sent.reply.code, 500);
	assert.deepEqual(sent.reply.json, { idem: 'failed', retryable: true, error_code: 'n8n_workflow_failed', effect: 'unknown' });
	assert.ok(sent.claims[1].url.endsWith('/fail'));
});
