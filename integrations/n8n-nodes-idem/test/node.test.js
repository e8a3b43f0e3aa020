// The Idem node's execute() with a scripted gateway in place of n8n's HTTP helper: which
// output each item takes, what it carries, what is thrown. No n8n process, no network.
const test = require('node:test');
const assert = require('node:assert/strict');
const { NodeApiError, NodeOperationError } = require('n8n-workflow');

const { Idem } = require('../dist/nodes/Idem/Idem.node.js');
const { IdemApi } = require('../dist/credentials/IdemApi.credentials.js');

const CREDENTIALS = { baseUrl: 'http://idem.test', claimsToken: 'claims-secret' };

/**
 * A fake IExecuteFunctions: `parameters` by name (the same for every item), `answers` the
 * gateway's replies in order (an Error is a transport failure). Requests are recorded.
 */
function context({ parameters, answers, items = [{ json: { body: { id: 'evt-1' } } }], continueOnFail = false }) {
	const requests = [];
	const queue = [...answers];
	return {
		requests,
		getInputData: () => items,
		getNodeParameter: (name, _index, fallback) => (name in parameters ? parameters[name] : fallback),
		getCredentials: async (type) => {
			assert.equal(type, 'idemApi');
			return CREDENTIALS;
		},
		getNode: () => ({ id: 'n1', name: 'Idem', type: 'n8n-nodes-idem.idem', typeVersion: 1, position: [0, 0], parameters: {} }),
		getWorkflow: () => ({ id: 'wf1', name: 'CRM follow-up', active: true }),
		getExecutionId: () => '42',
		continueOnFail: () => continueOnFail,
		helpers: {
			httpRequest: async (options) => {
				requests.push(options);
				const next = queue.shift();
				if (next === undefined) throw new Error('no scripted answer left');
				if (next instanceof Error) throw next;
				return { statusCode: next[0], headers: next[2] ?? {}, body: JSON.stringify(next[1]) };
			},
		},
	};
}

async function run(options) {
	const fake = context(options);
	const outputs = await new Idem().execute.call(fake);
	return { outputs, requests: fake.requests };
}

const CLAIM = { operation: 'claim', key: 'n8n:crm-follow-up:evt-1', payload: '{"event_id": "evt-1"}', leaseSeconds: 60 };

function routeOf(outputs) {
	const names = ['Act', 'Look First', 'Done', 'Busy', 'Dead', 'Refused'];
	assert.equal(outputs.length, names.length);
	const used = outputs.map((items, index) => (items.length ? names[index] : null)).filter(Boolean);
	assert.equal(used.length, 1, `one output used, got ${used}`);
	return used[0];
}

test('claimed: the item goes to Act with the lease token and keeps its own data', async () => {
	const { outputs, requests } = await run({
		parameters: CLAIM,
		answers: [[201, { status: 'claimed', key: CLAIM.key, lease_token: '3.abc', uncertain: false, reclaimed: false }]],
	});
	assert.equal(routeOf(outputs), 'Act');
	const [item] = outputs[0];
	assert.deepEqual(item.json.body, { id: 'evt-1' });
	assert.equal(item.json.idem.lease_token, '3.abc');
	assert.equal(item.json.idem.key, CLAIM.key);
	assert.equal(item.json.idem.outcome, 'act');
	assert.deepEqual(item.pairedItem, { item: 0 });
	assert.equal(requests[0].url, 'http://idem.test/v1/claims');
	assert.equal(requests[0].headers.Authorization, 'Bearer claims-secret');
	assert.equal(requests[0].ignoreHttpStatusErrors, true);
	assert.equal(JSON.parse(requests[0].body).workflow, 'CRM follow-up');
});

test('uncertain: Look First; already succeeded: Done with the stored result; dead: Dead', async () => {
	const uncertain = await run({
		parameters: CLAIM,
		answers: [[201, { status: 'claimed', lease_token: 't', uncertain: true, reclaimed: true }]],
	});
	assert.equal(routeOf(uncertain.outputs), 'Look First');
	const done = await run({
		parameters: CLAIM,
		answers: [[200, { status: 'already_succeeded', result: { task_id: 'T-1' }, external_ref: 'T-1' }, { 'idempotent-replayed': 'true' }]],
	});
	assert.equal(routeOf(done.outputs), 'Done');
	assert.deepEqual(done.outputs[2][0].json.idem.result, { task_id: 'T-1' });
	assert.equal(done.outputs[2][0].json.idem.replayed, true);
	const dead = await run({ parameters: CLAIM, answers: [[409, { status: 'failed_final', error_code: 'x' }]] });
	assert.equal(routeOf(dead.outputs), 'Dead');
});

test('busy: waits Retry-After and claims again, bounded by Max Rounds', async () => {
	const busy = [409, { status: 'in_progress', retry_after: 1 }, { 'retry-after': '1' }];
	const finished = await run({
		parameters: { ...CLAIM, waitWhileBusy: true, maxRounds: 3, maxWaitSeconds: 1 },
		answers: [busy, [200, { status: 'already_succeeded', result: {} }]],
	});
	assert.equal(routeOf(finished.outputs), 'Done');
	assert.equal(finished.requests.length, 2);
	assert.equal(finished.outputs[2][0].json.idem.busy_rounds, 1);

	const gaveUp = await run({
		parameters: { ...CLAIM, waitWhileBusy: true, maxRounds: 1, maxWaitSeconds: 1 },
		answers: [busy, busy],
	});
	assert.equal(routeOf(gaveUp.outputs), 'Busy');
	assert.equal(gaveUp.requests.length, 2);
	assert.equal(gaveUp.outputs[3][0].json.idem.retry_after, 1);

	const noWait = await run({ parameters: { ...CLAIM, waitWhileBusy: false }, answers: [busy] });
	assert.equal(routeOf(noWait.outputs), 'Busy');
	assert.equal(noWait.requests.length, 1);
});

test('a refused claim goes to Refused: status is the string "refused", the HTTP code is http_status', async () => {
	for (const [code, body, error] of [
		[422, { type: 'urn:idem:error:idempotency_key_reused', status: 422, error: 'idempotency_key_reused', detail: 'd' }, 'idempotency_key_reused'],
		[401, { type: 'urn:idem:error:unauthorized', status: 401, error: 'unauthorized' }, 'unauthorized'],
		[409, { type: 'urn:idem:error:not_a_claim_key', status: 409, error: 'not_a_claim_key' }, 'not_a_claim_key'],
	]) {
		const { outputs } = await run({ parameters: CLAIM, answers: [[code, body]] });
		assert.equal(routeOf(outputs), 'Refused');
		const { idem } = outputs[5][0].json;
		assert.equal(idem.status, 'refused', String(code));
		assert.equal(idem.http_status, code);
		assert.equal(idem.error, error);
		assert.equal(idem.key, CLAIM.key);
		assert.equal(idem.status_code, undefined);
	}
});

test('every outcome carries a state string in status and a number in http_status', async () => {
	const table = [
		[[201, { status: 'claimed', lease_token: 't', uncertain: false }], 'claimed', 201],
		[[200, { status: 'already_succeeded', result: {} }], 'already_succeeded', 200],
		[[409, { status: 'in_progress' }], 'in_progress', 409],
		[[409, { status: 'failed_final', error_code: 'x' }], 'failed_final', 409],
	];
	for (const [answer, status, httpStatus] of table) {
		const { outputs } = await run({ parameters: { ...CLAIM, waitWhileBusy: false }, answers: [answer] });
		const item = outputs.flat()[0];
		assert.equal(item.json.idem.status, status);
		assert.equal(item.json.idem.http_status, httpStatus);
	}
});

test('a transport error or a 503 is thrown as NodeApiError (Retry On Fail applies)', async () => {
	await assert.rejects(
		run({ parameters: CLAIM, answers: [Object.assign(new Error('connect ECONNREFUSED'), { code: 'ECONNREFUSED' })] }),
		// n8n words known transport codes itself ("The service refused the connection ...").
		(error) => error instanceof NodeApiError,
	);
	await assert.rejects(
		run({ parameters: CLAIM, answers: [[503, { error: 'database_unavailable', detail: 'down' }, { 'retry-after': '5' }]] }),
		(error) => error instanceof NodeApiError && /database_unavailable/.test(error.message) && error.httpCode === '503',
	);
});

test('with Continue On Fail, a transport error leaves on Refused, never on Act, marked for n8n’s error output', async () => {
	const { outputs } = await run({ parameters: CLAIM, answers: [new Error('socket hang up')], continueOnFail: true });
	assert.equal(routeOf(outputs), 'Refused');
	const [item] = outputs[5];
	// n8n's "Continue (using error output)" moves items that carry `error` to the error output.
	assert.ok(item.error instanceof NodeApiError);
	assert.match(item.json.error, /did not answer/);
	assert.deepEqual(item.json.body, { id: 'evt-1' }, 'the item keeps its data');
	assert.equal(item.json.idem.status, 'unavailable');
	assert.equal(item.json.idem.key, CLAIM.key);
});

test('an empty key is a NodeOperationError and nothing is sent', async () => {
	const fake = context({ parameters: { ...CLAIM, key: '' }, answers: [] });
	await assert.rejects(new Idem().execute.call(fake), (error) => error instanceof NodeOperationError && /Key is empty/.test(error.message));
	assert.equal(fake.requests.length, 0);
});

test('complete takes key and lease token from its parameters; lease_lost is thrown, never a success', async () => {
	const parameters = { operation: 'complete', key: 'k', leaseToken: '3.abc', result: { task_id: 'T-1' }, externalRef: 'T-1' };
	const done = await run({ parameters, answers: [[200, { status: 'succeeded', key: 'k', external_ref: 'T-1' }]] });
	assert.equal(done.outputs.length, 1);
	assert.equal(done.outputs[0][0].json.idem.status, 'succeeded');
	assert.equal(done.outputs[0][0].json.idem.http_status, 200);
	assert.equal(done.outputs[0][0].json.idem.lease_token, '3.abc');
	assert.equal(done.requests[0].url, 'http://idem.test/v1/claims/k/complete');
	assert.deepEqual(JSON.parse(done.requests[0].body), { lease_token: '3.abc', result: { task_id: 'T-1' }, external_ref: 'T-1' });
	await assert.rejects(
		run({ parameters, answers: [[409, { status: 'lease_lost', key: 'k', detail: 'gone' }]] }),
		(error) => error instanceof NodeApiError && error.httpCode === '409' && /refused Complete \(HTTP 409 lease_lost\)/.test(error.message),
	);
});

test('with Continue On Fail, a refusal of Complete, Fail, Heartbeat or Send Event carries the error, a string status and the lease', async () => {
	const cases = [
		['complete', { key: 'k', leaseToken: '3.abc' }, [409, { status: 'lease_lost', key: 'k' }], 'lease_lost'],
		['fail', { key: 'k', leaseToken: '3.abc', errorCode: 'x', retryable: true }, [409, { status: 'lease_lost', key: 'k' }], 'lease_lost'],
		['heartbeat', { key: 'k', leaseToken: '3.abc' }, [409, { status: 'lease_lost', key: 'k' }], 'lease_lost'],
		[
			'sendEvent',
			{ source: 's', eventType: 't', externalId: '1', eventPayload: { a: 1 } },
			[422, { type: 'urn:idem:error:idempotency_key_reused', status: 422, error: 'idempotency_key_reused' }],
			'idempotency_key_reused',
		],
		['sendEvent', { source: 's', eventType: 't', externalId: '1', eventPayload: { a: 1 } }, [401, { status: 401, error: 'invalid_signature' }], 'invalid_signature'],
	];
	for (const [operation, parameters, answer, code] of cases) {
		const items = [{ json: { idem: { key: 'k', lease_token: '3.abc', status: 'claimed' } } }];
		const { outputs } = await run({ parameters: { operation, ...parameters }, answers: [answer], items, continueOnFail: true });
		assert.equal(outputs.length, 1);
		const [item] = outputs[0];
		assert.ok(item.error instanceof NodeApiError, operation);
		assert.match(item.json.error, /refused/);
		assert.equal(item.json.idem.status, 'refused', operation);
		assert.equal(item.json.idem.http_status, answer[0]);
		assert.equal(item.json.idem.error, code);
		assert.equal(item.json.idem.key, 'k');
		assert.equal(item.json.idem.lease_token, '3.abc');
	}
});

test('get event: a 404 is an answer (status not_found), not a refusal', async () => {
	const { outputs } = await run({
		parameters: { operation: 'getEvent', key: 'nope' },
		answers: [[404, { type: 'urn:idem:error:key_not_found', status: 404, error: 'key_not_found' }]],
	});
	assert.equal(outputs[0][0].json.idem.status, 'not_found');
	assert.equal(outputs[0][0].json.idem.http_status, 404);
});

test('fail sends retryable and effect', async () => {
	const parameters = { operation: 'fail', key: 'k', leaseToken: 't', errorCode: 'http_503', retryable: true, effect: 'unknown' };
	const { requests, outputs } = await run({ parameters, answers: [[200, { status: 'failed_retryable', key: 'k' }]] });
	assert.deepEqual(JSON.parse(requests[0].body), { lease_token: 't', error_code: 'http_503', retryable: true, effect: 'unknown' });
	assert.equal(outputs[0][0].json.idem.status, 'failed_retryable');
});

test('send event posts the envelope from fields with workflow and execution id', async () => {
	const parameters = {
		operation: 'sendEvent',
		envelope: 'fields',
		source: 'webform',
		eventType: 'crm.lead.created',
		externalId: 'evt-1',
		eventPayload: { email: 'ada@example.com' },
		idempotencyKey: 'webform:evt-1',
	};
	const { requests, outputs } = await run({ parameters, answers: [[202, { status: 'pending', duplicate: false }]] });
	assert.deepEqual(JSON.parse(requests[0].body), {
		source: 'webform',
		event_type: 'crm.lead.created',
		external_id: 'evt-1',
		payload: { email: 'ada@example.com' },
		workflow: 'CRM follow-up',
		execution_id: '42',
	});
	assert.equal(requests[0].headers['Idempotency-Key'], 'webform:evt-1');
	assert.equal(outputs[0][0].json.idem.duplicate, false);
});

test('the outputs expression gives Claim six named outputs and every other operation one', () => {
	const { description } = new Idem();
	assert.match(description.outputs, /^=\{\{[\s\S]*\}\}$/);
	const evaluate = (operation) =>
		// The expression is plain JavaScript over $parameter, as n8n evaluates it.
		new Function('$parameter', `return ${description.outputs.slice(3, -2)}`)({ operation });
	assert.deepEqual(
		evaluate('claim').map((output) => output.displayName),
		['Act', 'Look First', 'Done', 'Busy', 'Dead', 'Refused'],
	);
	assert.equal(evaluate(undefined).length, 6, 'the default operation is claim');
	for (const operation of ['sendEvent', 'complete', 'fail', 'heartbeat', 'getEvent']) {
		assert.deepEqual(evaluate(operation), ['main'], operation);
	}
});

test('the credential is Idem API with base URL, claims token, operator token and the two signing secrets', () => {
	const credential = new IdemApi();
	assert.equal(credential.name, 'idemApi');
	assert.equal(credential.displayName, 'Idem API');
	assert.deepEqual(
		credential.properties.map((p) => p.name),
		['baseUrl', 'claimsToken', 'operatorToken', 'signingSecret', 'deliverySigningSecret'],
	);
	for (const secret of credential.properties.slice(1)) assert.equal(secret.typeOptions.password, true, secret.name);
});

// ------------------------------------------------------------------ chained as in a workflow

/**
 * A parameter as n8n resolves it for one item: the value set in the workflow, else the
 * property's default for this operation; an expression `={{ … }}` is evaluated against the
 * item's JSON (only `$json` is needed by the node's defaults).
 */
function resolveParameter(operation, set, name, json, fallback) {
	const property = new Idem().description.properties.find(
		(p) => p.name === name && (!p.displayOptions?.show?.operation || p.displayOptions.show.operation.includes(operation)),
	);
	const value = name in set ? set[name] : property ? property.default : fallback;
	if (typeof value === 'string' && value.startsWith('={{') && value.endsWith('}}')) {
		return new Function('$json', `return (${value.slice(3, -2)})`)(json);
	}
	return value;
}

/** One node of a workflow: `set` the parameters the workflow sets, items from the node before. */
async function step(operation, set, items, answers) {
	const fake = context({ parameters: {}, answers, items });
	fake.getNodeParameter = (name, index, fallback) =>
		name === 'operation' ? operation : resolveParameter(operation, set, name, items[index].json, fallback);
	const outputs = await new Idem().execute.call(fake);
	return { outputs, requests: fake.requests };
}

test('Claim → Heartbeat → Complete with the default parameters: the lease token survives the heartbeat', async () => {
	const webhookItem = { json: { body: { id: 'evt-1' }, headers: { 'x-signature': 'a' } } };
	const claimed = await step('claim', { key: CLAIM.key, payload: '{"event_id": "evt-1"}' }, [webhookItem], [
		[201, { status: 'claimed', key: CLAIM.key, lease_token: '3.abc', uncertain: false, reclaimed: false }],
	]);
	const act = claimed.outputs[0];
	assert.equal(act.length, 1);

	const beat = await step('heartbeat', {}, act, [
		[200, { status: 'claimed', key: CLAIM.key, locked_until: '2030-01-01T00:00:00+00:00' }],
	]);
	const afterBeat = beat.outputs[0][0].json.idem;
	assert.equal(afterBeat.key, CLAIM.key);
	assert.equal(afterBeat.lease_token, '3.abc', 'the heartbeat answer has no token: the claim’s stays');
	assert.equal(afterBeat.locked_until, '2030-01-01T00:00:00+00:00');
	assert.deepEqual(JSON.parse(beat.requests[0].body), { lease_token: '3.abc', lease_seconds: 60 });

	const done = await step('complete', { result: { task_id: 'T-1' } }, beat.outputs[0], [
		[200, { status: 'succeeded', key: CLAIM.key, external_ref: null }],
	]);
	assert.equal(done.requests[0].url, `http://idem.test/v1/claims/${encodeURIComponent(CLAIM.key)}/complete`);
	assert.equal(JSON.parse(done.requests[0].body).lease_token, '3.abc');
	const final = done.outputs[0][0].json;
	assert.equal(final.idem.status, 'succeeded');
	assert.equal(final.idem.key, CLAIM.key);
	assert.equal(final.idem.lease_token, '3.abc');
	assert.deepEqual(final.body, { id: 'evt-1' }, 'the item’s own fields are kept');
});

test('Get Event and Send Event after a claim keep the claim’s key and lease token', async () => {
	const claimedItem = { json: { idem: { key: 'claim-key', lease_token: '9.zz', status: 'claimed', outcome: 'act' } } };
	const looked = await step('getEvent', { key: 'claim-key' }, [claimedItem], [[200, { key: 'claim-key', status: 'processing', attempts: 1 }]]);
	assert.equal(looked.outputs[0][0].json.idem.lease_token, '9.zz');
	assert.equal(looked.outputs[0][0].json.idem.status, 'processing');
	const sent = await step(
		'sendEvent',
		{ source: 's', eventType: 't', externalId: '1', eventPayload: { a: 1 } },
		[claimedItem],
		[[202, { key: 's:t:1', status: 'pending', duplicate: false }]],
	);
	const idem = sent.outputs[0][0].json.idem;
	assert.equal(idem.key, 'claim-key');
	assert.equal(idem.lease_token, '9.zz');
	assert.equal(idem.event_key, 's:t:1');
	assert.equal(idem.outcome, undefined, 'the claim’s routing is not carried onto a later answer');
});

test('a fan-out event: Get Event and a duplicate Send Event leave on the output with its deliveries', async () => {
	const deliveries = [
		{ destination: 'crm', key: 'stripe:e1 @crm', status: 'succeeded', attempts: 1, result: { id: 'T-1' }, external_ref: 'T-1', error_code: null },
		{ destination: 'finance-flow', key: 'stripe:e1 @finance-flow', status: 'failed_final', attempts: 1, result: null, external_ref: null, error_code: 'http_422' },
		{ destination: 'slack', key: 'stripe:e1 @slack', status: 'succeeded', attempts: 1, result: null, external_ref: null, error_code: null },
	];
	const state = { key: 'stripe:e1', status: 'partially_failed', attempts: 0, deliveries };
	const looked = await step('getEvent', { key: 'stripe:e1' }, [{ json: {} }], [[200, state]]);
	assert.equal(looked.outputs[0].length, 1, 'a success, not an error');
	const idem = looked.outputs[0][0].json.idem;
	assert.equal(idem.status, 'partially_failed');
	assert.equal(idem.finished, true);
	assert.deepEqual(idem.failed_destinations, ['finance-flow']);
	assert.deepEqual(idem.deliveries, deliveries);
	const sent = await step(
		'sendEvent',
		{ source: 'stripe', eventType: 'invoice.paid', externalId: 'in_1', eventPayload: { a: 1 } },
		[{ json: {} }],
		[[200, { ...state, duplicate: true }, { 'idempotent-replayed': 'true' }]],
	);
	const again = sent.outputs[0][0].json.idem;
	assert.equal(again.duplicate, true);
	assert.equal(again.replayed, true);
	assert.deepEqual([again.status, again.finished, again.failed_destinations], ['partially_failed', true, ['finance-flow']]);
	assert.deepEqual(again.deliveries, deliveries);
});

test('Send Event after a Webhook node: a redelivery with other headers sends the same payload and body', async () => {
	const set = { source: 'webform', eventType: 'crm.lead.created', externalId: 'evt-1', idempotencyKey: 'webform:evt-1' };
	const webhookItem = (headers) => ({
		json: { headers, params: {}, query: {}, body: { id: 'evt-1', data: { email: 'ada@example.com' } }, webhookUrl: 'http://n8n/webhook/x', executionMode: 'production' },
	});
	const first = await step('sendEvent', set, [webhookItem({ 'x-signature': 't=1,v1=aa', authorization: 'Bearer secret' })], [
		[202, { key: 'webform:evt-1', status: 'pending', duplicate: false }],
	]);
	const again = await step('sendEvent', set, [webhookItem({ 'x-signature': 't=2,v1=bb', 'x-delivery': '2' })], [
		[200, { key: 'webform:evt-1', status: 'succeeded', duplicate: true }],
	]);
	const sent = JSON.parse(first.requests[0].body);
	assert.deepEqual(sent.payload, { id: 'evt-1', data: { email: 'ada@example.com' } });
	assert.equal(JSON.stringify(sent).includes('secret'), false, 'no header reaches the gateway');
	const resent = JSON.parse(again.requests[0].body);
	assert.deepEqual(resent.payload, sent.payload);
	assert.equal(again.outputs[0][0].json.idem.status, 'succeeded');
	assert.equal(again.outputs[0][0].json.idem.duplicate, true);
});

test('Busy with the default settings answers within 6 s even when Retry-After is the whole lease', async () => {
	const busy = [409, { status: 'in_progress', retry_after: 55 }, { 'retry-after': '55' }];
	const started = Date.now();
	// Parameters the workflow leaves at their defaults come from the node's description.
	const { outputs, requests } = await step('claim', { key: CLAIM.key, payload: '{}' }, [{ json: {} }], [busy, busy, busy]);
	const seconds = (Date.now() - started) / 1000;
	assert.equal(outputs[3].length, 1, 'Busy');
	assert.equal(requests.length, 3, 'the first claim and two rounds');
	assert.ok(seconds >= 3.9 && seconds < 6, `answered after ${seconds} s`);
	assert.equal(outputs[3][0].json.idem.busy_rounds, 2);
	const properties = new Idem().description.properties;
	const rounds = properties.find((p) => p.name === 'maxRounds').default;
	const cap = properties.find((p) => p.name === 'maxWaitSeconds').default;
	assert.ok(rounds * cap <= 6, `${rounds} rounds of ${cap} s`);
});

test('the credential test looks up a made-up key with the claims token: 404 passes, 401/403/429 fail', () => {
	const { test: check } = new IdemApi();
	const { request, rules } = check;
	assert.equal(request.method, 'GET');
	assert.match(request.url, /^\/v1\/events\/[\w-]+$/);
	assert.notEqual(request.url, '/healthz');
	assert.equal(request.ignoreHttpStatusErrors, true, 'a 404 must not fail the test');
	const expression = (value, credentials) => new Function('$credentials', `return (${value.slice(3, -2)})`)(credentials);
	assert.equal(expression(request.headers.Authorization, { claimsToken: 'abc' }), 'Bearer abc');
	assert.equal(expression(request.headers.Authorization, { claimsToken: '' }), '');
	assert.equal(expression(request.baseURL, { baseUrl: 'http://idem:8000//' }), 'http://idem:8000');
	// n8n's credential tester: with every status answered, a responseSuccessBody rule whose key
	// holds its value fails the test with the rule's message; otherwise "Connection successful".
	const verdict = (body) => {
		for (const rule of rules) {
			if (rule.type === 'responseSuccessBody' && body[rule.properties.key] === rule.properties.value) return rule.properties.message;
		}
		return 'OK';
	};
	const problem = (status, error) => ({ type: `urn:idem:error:${error}`, status, error });
	assert.equal(verdict(problem(404, 'key_not_found')), 'OK');
	assert.match(verdict(problem(401, 'unauthorized')), /401/);
	assert.match(verdict(problem(403, 'claims_forbidden')), /403/);
	assert.match(verdict(problem(429, 'too_many_failures')), /429/);
});

// ---------------------------------------------------------------- Dedupe

const DEDUPE = { operation: 'dedupe', key: 'dedupe:evt-1', ttlSeconds: 3600 };

test('dedupe: 201 seen false goes to New, with the key and no lease', async () => {
	const { outputs, requests } = await run({ parameters: DEDUPE, answers: [[201, { seen: false, key: 'dedupe:evt-1' }]] });
	assert.equal(outputs.length, 2);
	assert.equal(outputs[0].length, 1);
	assert.equal(outputs[1].length, 0);
	const idem = outputs[0][0].json.idem;
	assert.equal(idem.status, 'new');
	assert.equal(idem.key, 'dedupe:evt-1');
	assert.equal(idem.http_status, 201);
	assert.equal(idem.lease_token, undefined);
	assert.deepEqual(outputs[0][0].json.body, { id: 'evt-1' });
	assert.equal(requests[0].url, 'http://idem.test/v1/claims/dedupe');
	assert.equal(requests[0].method, 'POST');
	assert.equal(requests[0].headers.Authorization, 'Bearer claims-secret');
	assert.deepEqual(JSON.parse(requests[0].body), { key: 'dedupe:evt-1', ttl_seconds: 3600, workflow: 'CRM follow-up' });
});

test('dedupe: 200 seen true goes to Seen with first_seen_at', async () => {
	const at = '2026-01-01T00:00:00+00:00';
	const { outputs } = await run({
		parameters: DEDUPE,
		answers: [[200, { seen: true, key: 'dedupe:evt-1', first_seen_at: at, expires_at: at }]],
	});
	assert.equal(outputs[0].length, 0);
	assert.equal(outputs[1].length, 1);
	assert.equal(outputs[1][0].json.idem.status, 'seen');
	assert.equal(outputs[1][0].json.idem.first_seen_at, at);
});

test('dedupe: two items, the second a repeat, split New / Seen in order', async () => {
	const items = [{ json: { n: 1 } }, { json: { n: 2 } }];
	const { outputs } = await run({
		parameters: DEDUPE,
		items,
		answers: [
			[201, { seen: false, key: 'dedupe:evt-1' }],
			[200, { seen: true, key: 'dedupe:evt-1', first_seen_at: 'x' }],
		],
	});
	assert.deepEqual(outputs[0].map((item) => item.json.n), [1]);
	assert.deepEqual(outputs[1].map((item) => item.json.n), [2]);
	assert.deepEqual(outputs[1][0].pairedItem, { item: 1 });
});

test('dedupe: a key in other use is refused (an error, never New)', async () => {
	await assert.rejects(
		run({ parameters: DEDUPE, answers: [[409, { error: 'key_in_other_use', detail: 'x' }]] }),
		(error) => error instanceof NodeApiError && /key_in_other_use|Dedupe/.test(error.message),
	);
	const { outputs } = await run({
		parameters: DEDUPE,
		continueOnFail: true,
		answers: [[409, { error: 'key_in_other_use' }]],
	});
	assert.equal(outputs[0].length, 0);
	assert.equal(outputs[1].length, 1);
	assert.equal(outputs[1][0].json.idem.status, 'refused');
	assert.equal(outputs[1][0].json.idem.error, 'key_in_other_use');
});

test('dedupe: a bad TTL is refused before anything is sent', async () => {
	for (const ttlSeconds of [0, 1.5, 'x', 31_536_001]) {
		await assert.rejects(
			run({ parameters: { ...DEDUPE, ttlSeconds }, answers: [] }),
			(error) => error instanceof NodeOperationError && /TTL Seconds/.test(error.message),
		);
	}
});

test('dedupe: the gateway unavailable throws (Retry On Fail repeats it)', async () => {
	await assert.rejects(
		run({ parameters: DEDUPE, answers: [[503, { error: 'database_unavailable' }]] }),
		(error) => error instanceof NodeApiError,
	);
});

/** `step` inside an execution started by an Idem Trigger named `Gateway`, whose item was `triggerItem`. */
async function stepAfterTrigger(operation, set, items, answers, triggerItem) {
	const fake = context({ parameters: {}, answers, items });
	fake.getNodeParameter = (name, index, fallback) => {
		if (name === 'operation') return operation;
		if ((name === 'key' || name === 'leaseToken') && !(name in set)) {
			// n8n evaluating `$json.idem.key` on an item without `idem`.
			throw new Error("Cannot read properties of undefined (reading 'key')");
		}
		return resolveParameter(operation, set, name, items[index].json, fallback);
	};
	fake.getParentNodes = () => [
		{ name: 'CRM', type: 'n8n-nodes-base.httpRequest' },
		{ name: 'Gateway', type: 'n8n-nodes-idem.idemTrigger' },
	];
	fake.getWorkflowDataProxy = () => ({
		$: (name) => {
			if (name !== 'Gateway') throw new Error(`no node ${name}`);
			return { item: { json: triggerItem } };
		},
	});
	const outputs = await new Idem().execute.call(fake);
	return { outputs, requests: fake.requests };
}

test('Idem Trigger → HTTP Request → Complete with the defaults: the trigger’s claim is completed', async () => {
	// The HTTP Request replaced the item: `$json.idem` is gone.
	const crmAnswer = [{ json: { id: 'task-7' } }];
	const triggerItem = { key: 'webform:evt-7', idem: { key: 'n8n-trigger:webform:evt-7', lease_token: '5.tok' } };
	const done = await stepAfterTrigger('complete', { result: { task_id: 'task-7' } }, crmAnswer, [[200, { status: 'succeeded' }]], triggerItem);
	assert.equal(done.requests.length, 1);
	assert.equal(done.requests[0].url, 'http://idem.test/v1/claims/n8n-trigger%3Awebform%3Aevt-7/complete');
	assert.deepEqual(JSON.parse(done.requests[0].body), { lease_token: '5.tok', result: { task_id: 'task-7' } });
	assert.equal(done.outputs[0][0].json.idem.status, 'succeeded');

	const failed = await stepAfterTrigger('fail', { errorCode: 'crm_http_500' }, crmAnswer, [[200, { status: 'failed_retryable' }]], triggerItem);
	assert.ok(failed.requests[0].url.endsWith('/n8n-trigger%3Awebform%3Aevt-7/fail'));
	assert.equal(JSON.parse(failed.requests[0].body).lease_token, '5.tok');

	// Without a trigger's claim the empty key is still the clear error it was.
	await assert.rejects(
		stepAfterTrigger('complete', {}, crmAnswer, [], { key: 'webform:evt-7' }),
		(error) => error instanceof NodeOperationError && /Key is empty/.test(error.message),
	);
});
