// The Idem Trigger's end of an execution (dist/nodes/IdemTrigger/afterRun.js) and where
// Complete finds the trigger's claim (dist/nodes/Idem/triggerLease.js): a fake claims API
// records the requests and answers as the gateway does.
const test = require('node:test');
const assert = require('node:assert/strict');

const afterRun = require('../dist/nodes/IdemTrigger/afterRun.js');
const trigger = require('../dist/nodes/IdemTrigger/trigger.js');
const { leaseToUse, triggerNames } = require('../dist/nodes/Idem/triggerLease.js');

const CLAIM = { credentials: { baseUrl: 'http://gw', claimsToken: 't' }, key: 'n8n-trigger:k1', leaseToken: '7.abc' };

function answer(statusCode, body) {
	return { statusCode, headers: {}, body: JSON.stringify(body) };
}

/** A claims API answering each path (`/complete`, `/fail`, `/v1/events/`) from `answers`. */
function claimsApi(answers) {
	const sent = [];
	const call = async (request) => {
		sent.push({ url: request.url, body: request.body ? JSON.parse(request.body) : undefined });
		for (const [suffix, reply] of Object.entries(answers)) {
			if (request.url.includes(suffix)) return reply;
		}
		throw new Error(`unexpected ${request.url}`);
	};
	return { sent, call };
}

const LAST_ITEM = { id: 'task-1', idem: { key: CLAIM.key, lease_token: CLAIM.leaseToken, status: 'claimed' } };

test('a run that ends with an item completes the claim with it, without idem, and answers that', async () => {
	const api = claimsApi({ '/complete': answer(200, { status: 'succeeded', key: CLAIM.key }) });
	const reply = await afterRun.answerAfterRun({ statusCode: 200, body: LAST_ITEM }, CLAIM, api.call);
	assert.deepEqual(reply, { statusCode: 200, body: { id: 'task-1' }, headers: {} });
	assert.equal(api.sent.length, 1);
	assert.deepEqual(api.sent[0].body, { lease_token: '7.abc', result: { id: 'task-1' } });
	assert.ok(!JSON.stringify(reply).includes('7.abc'), 'the lease token is never answered');
});

test('after the workflow’s own Complete, the answer is the result it stored (as a re-send gets)', async () => {
	const stored = { task_id: 'task-1' };
	const api = claimsApi({
		'/complete': answer(200, { status: 'succeeded', key: CLAIM.key, repeated: true }),
		'/v1/events/': answer(200, { status: 'succeeded', result: stored, external_ref: 'task-1' }),
	});
	const first = await afterRun.answerAfterRun({ statusCode: 200, body: LAST_ITEM }, CLAIM, api.call);
	assert.deepEqual(first.body, stored);
	assert.equal(first.statusCode, 200);
	// A re-send after the run: the claim answers already_succeeded with the same result.
	const resend = trigger.triggerAction(answer(200, { status: 'already_succeeded', result: stored }));
	assert.deepEqual(resend.reply.body, first.body);
});

test('the same shape whichever way the answer comes: a first try and a re-send', async () => {
	const api = claimsApi({ '/complete': answer(200, { status: 'succeeded' }) });
	const first = await afterRun.answerAfterRun({ statusCode: 200, body: LAST_ITEM }, CLAIM, api.call);
	const resend = trigger.triggerAction(answer(200, { status: 'already_succeeded', result: api.sent[0].body.result }));
	assert.deepEqual(resend.reply.body, first.body);
	assert.equal(resend.reply.statusCode, first.statusCode);
});

test('a value that is not an object is stored and answered as {result}', async () => {
	assert.deepEqual(afterRun.cleanResult([1, 2]), { result: [1, 2] });
	assert.deepEqual(afterRun.cleanResult(undefined), { result: null });
	assert.deepEqual(afterRun.storedAnswer('ok').body, { result: 'ok' });
});

test('a failed run frees the claim (retryable, effect unknown) and answers a transient failure', async () => {
	const api = claimsApi({ '/fail': answer(200, { status: 'failed_retryable', key: CLAIM.key }) });
	const reply = await afterRun.answerAfterRun(
		{ statusCode: 500, body: { message: 'Error in workflow' } },
		CLAIM,
		api.call,
	);
	assert.equal(reply.statusCode, 500);
	assert.deepEqual(reply.body, { idem: 'failed', retryable: true, error_code: 'n8n_workflow_failed', effect: 'unknown' });
	assert.equal(api.sent[0].body.retryable, true);
	assert.equal(api.sent[0].body.effect, 'unknown');
	assert.equal(api.sent[0].body.detail, 'Error in workflow');
});

test('a workflow whose Fail node dead-lettered the claim is answered as a permanent failure', async () => {
	const api = claimsApi({
		'/complete': answer(409, { status: 'lease_lost' }),
		'/v1/events/': answer(200, { status: 'failed_final', error_code: 'crm_http_422', uncertain: false }),
	});
	const reply = await afterRun.answerAfterRun({ statusCode: 200, body: { error: 'x' } }, CLAIM, api.call);
	assert.deepEqual(reply, { statusCode: 409, body: { idem: 'failed_final', error_code: 'crm_http_422' }, headers: {} });
});

test('a retryable Fail node, a lease taken over, an unreachable gateway: each has its answer', async () => {
	const retryable = afterRun.answerFromState(answer(200, { status: 'failed_retryable', error_code: 'crm_down', uncertain: false }));
	assert.deepEqual(retryable.body, { idem: 'failed', retryable: true, error_code: 'crm_down', effect: 'none' });
	const held = afterRun.answerFromState(answer(200, { status: 'processing' }));
	assert.equal(held.statusCode, 409);
	assert.equal(held.body.idem, 'in_progress');
	for (const none of [undefined, answer(503, {}), answer(404, {})]) {
		assert.equal(afterRun.answerFromState(none).statusCode, 502);
	}
	const api = claimsApi({ '/complete': undefined });
	const unreachable = await afterRun.answerAfterRun({ statusCode: 200, body: {} }, CLAIM, api.call);
	assert.equal(unreachable.statusCode, 502);
	assert.equal(api.sent.length, 1, 'no state is read when the gateway did not answer');
});

test('an uncertain claim starts on Look First with the earlier attempt’s facts', () => {
	const claim = { status: 'claimed', lease_token: '8.x', uncertain: true, attempt: 2, previous_error_code: 'n8n_workflow_failed' };
	assert.equal(trigger.triggerOutput(claim), trigger.LOOK_FIRST_OUTPUT);
	assert.equal(trigger.triggerOutput({ ...claim, uncertain: false }), trigger.ACT_OUTPUT);
	assert.deepEqual(trigger.TRIGGER_OUTPUT_NAMES, ['Act', 'Look First']);
	const item = trigger.triggerItem({ event: { a: 1 }, gatewayKey: 'k1', claimKey: 'n8n-trigger:k1', claim });
	assert.equal(item.uncertain, true);
	assert.equal(item.attempt, 2);
	assert.equal(item.previous_error_code, 'n8n_workflow_failed');
	assert.equal(item.idem.key, 'n8n-trigger:k1');
});

// ------------------------------------------------------------------ Complete finds the trigger's claim

const FROM_TRIGGER = { key: 'n8n-trigger:k1', lease_token: '7.abc' };

test('Key and Lease Token left empty (an HTTP Request replaced the item): the trigger’s claim', () => {
	assert.deepEqual(leaseToUse({ key: '', leaseToken: undefined }, FROM_TRIGGER), { key: 'n8n-trigger:k1', leaseToken: '7.abc' });
	assert.deepEqual(leaseToUse({ key: 'n8n-trigger:k1', leaseToken: '' }, FROM_TRIGGER), {
		key: 'n8n-trigger:k1',
		leaseToken: '7.abc',
	});
});

test('Key and Lease Token set (a Claim in the workflow) stand; another claim’s key is never mixed', () => {
	assert.deepEqual(leaseToUse({ key: 'crm:1', leaseToken: '9.z' }, FROM_TRIGGER), { key: 'crm:1', leaseToken: '9.z' });
	assert.deepEqual(leaseToUse({ key: 'crm:1', leaseToken: '' }, FROM_TRIGGER), { key: 'crm:1', leaseToken: '' });
	assert.deepEqual(leaseToUse({ key: '', leaseToken: '' }, undefined), { key: '', leaseToken: '' });
	assert.deepEqual(leaseToUse({ key: '', leaseToken: '' }, { key: 'n8n-trigger:k1' }), { key: '', leaseToken: '' });
});

test('the Idem Trigger is found among the parents whatever the package prefix', () => {
	const parents = [
		{ name: 'CRM', type: 'n8n-nodes-base.httpRequest' },
		{ name: 'Gateway', type: 'n8n-nodes-idem.idemTrigger' },
		{ name: 'Hook', type: 'n8n-nodes-base.webhook' },
		{ name: 'Local', type: 'CUSTOM.idemTrigger' },
	];
	assert.deepEqual(triggerNames(parents), ['Gateway', 'Local']);
});
