import {
	NodeApiError,
	NodeOperationError,
	sleep,
	type IDataObject,
	type IExecuteFunctions,
	type INodeExecutionData,
	type INodeProperties,
	type INodeType,
	type INodeTypeDescription,
	type JsonObject,
} from 'n8n-workflow';

import {
	BUSY_DEFAULT_MAX_WAIT_SECONDS,
	BUSY_DEFAULT_ROUNDS,
	CLAIM_OUTPUT_NAMES,
	CLAIM_ROUTES,
	IdemInputError,
	answerFields,
	busyWaitSeconds,
	claimRequest,
	claimRoute,
	completeRequest,
	dedupeRequest,
	dedupeRoute,
	defaultEventPayload,
	envelopeFromFields,
	failRequest,
	getEventRequest,
	heartbeatRequest,
	isRefusal,
	isUnavailable,
	jsonParameter,
	mergeIdem,
	refusalMessage,
	sendEventRequest,
	unavailableMessage,
	type ClaimRoute,
	type Effect,
	type GatewayAnswer,
	type Json,
	type GatewayRequest,
	type IdemCredentials,
	type JsonMap,
} from './protocol';
import { leaseToUse, triggerNames, type Lease } from './triggerLease';

type Operation = 'sendEvent' | 'claim' | 'complete' | 'fail' | 'heartbeat' | 'getEvent' | 'dedupe';

// A gateway call either answers within seconds or the gateway is unreachable; 10 s keeps a
// hung connection from holding the execution while leaving room for a slow database.
const DEFAULT_TIMEOUT_MS = 10_000;

const CLAIM_OUTPUTS = CLAIM_ROUTES.map((route) => ({ type: 'main', displayName: CLAIM_OUTPUT_NAMES[route] }));
// Outputs follow the operation: Claim has one per outcome, the others one. A parameter left at
// its default (claim) may be absent from the workflow JSON, hence `undefined`.
const DEDUPE_OUTPUTS = [
	{ type: 'main', displayName: 'New' },
	{ type: 'main', displayName: 'Seen' },
];
const OUTPUTS =
	`={{ ["claim", undefined].includes($parameter.operation) ? ${JSON.stringify(CLAIM_OUTPUTS)} : $parameter.operation === "dedupe" ? ${JSON.stringify(DEDUPE_OUTPUTS)} : ["main"] }}` as const;
const DEDUPE_NEW = 0;
const DEDUPE_SEEN = 1;

function show(...operation: Operation[]): INodeProperties['displayOptions'] {
	return { show: { operation } };
}

const LEASE_FIELDS: INodeProperties[] = [
	{
		displayName: 'Key',
		name: 'key',
		type: 'string',
		default: '={{ $json.idem.key }}',
		required: true,
		description:
			'The claimed key; by default the one a Claim put on the item, and when that is gone (an HTTP Request replaced the item) the claim of the Idem Trigger that started the execution',
		displayOptions: show('complete', 'fail', 'heartbeat'),
	},
	// Not a password field: it holds an expression reading the item, and the token is on the
	// item in plain sight anyway (it only fences this one claim, for its lease).
	{
		displayName: 'Lease Token',
		name: 'leaseToken',
		// eslint-disable-next-line n8n-nodes-base/node-param-type-options-password-missing
		type: 'string',
		default: '={{ $json.idem.lease_token }}',
		required: true,
		description:
			'The lease token of the claim; by default the one a Claim put on the item, and when that is gone the Idem Trigger’s',
		displayOptions: show('complete', 'fail', 'heartbeat'),
	},
];

export class Idem implements INodeType {
	description: INodeTypeDescription = {
		displayName: 'Idem',
		name: 'idem',
		icon: 'file:idem.svg',
		group: ['transform'],
		version: 1,
		subtitle: '={{$parameter["operation"]}}',
		description: 'Exactly-once side effects with the idem gateway: claim a key, act, complete',
		defaults: { name: 'Idem' },
		inputs: ['main'],
		outputs: OUTPUTS,
		credentials: [{ name: 'idemApi', required: true }],
		properties: [
			{
				displayName: 'Operation',
				name: 'operation',
				type: 'options',
				noDataExpression: true,
				default: 'claim',
				options: [
					{
						name: 'Claim',
						value: 'claim',
						description: 'Claim a key before a side effect; one output per outcome',
						action: 'Claim a key',
					},
					{
						name: 'Complete',
						value: 'complete',
						description: 'Record the side effect’s result under the claim',
						action: 'Complete a claim',
					},
					{
						name: 'Dedupe',
						value: 'dedupe',
						description: 'Test and mark a key for a time in one call: New the first time, Seen after (no lease)',
						action: 'Dedupe a key',
					},
					{
						name: 'Fail',
						value: 'fail',
						description: 'Record that the side effect failed, and whether it may have happened',
						action: 'Fail a claim',
					},
					{
						name: 'Get Event',
						value: 'getEvent',
						description: 'Look up the state and stored result of a key',
						action: 'Get an event',
					},
					{
						name: 'Heartbeat',
						value: 'heartbeat',
						description: 'Extend the lease while a long side effect runs',
						action: 'Extend a claim s lease',
					},
					{
						name: 'Send Event',
						value: 'sendEvent',
						description: 'Hand an event to the gateway; its worker runs the route’s action once',
						action: 'Send an event',
					},
				],
			},

			// ---------------------------------------------------------------- Claim
			{
				displayName:
					'Connect every output you use, or answer the caller with Respond to Webhook nodes. Behind a Webhook set to "When Last Node Finishes", an execution that ends on an output with nothing connected is answered 500 "No item to return was found" by n8n, and the sender delivers again.',
				name: 'claimOutputsNotice',
				type: 'notice',
				default: '',
				displayOptions: show('claim'),
			},
			{
				displayName: 'Key',
				name: 'key',
				type: 'string',
				default: '',
				required: true,
				placeholder: 'crm-follow-up:evt_8812',
				description: 'One key per business event and side effect, e.g. built from the provider’s event ID',
				displayOptions: show('claim', 'getEvent', 'dedupe'),
			},
			{
				displayName: 'TTL Seconds',
				name: 'ttlSeconds',
				type: 'number',
				typeOptions: { minValue: 1, maxValue: 31_536_000 },
				default: 86_400,
				description:
					'How long the key counts as seen; the gateway forgets it afterwards. Longer than the sender’s redelivery window.',
				displayOptions: show('dedupe'),
			},
			{
				displayName: 'Payload',
				name: 'payload',
				type: 'json',
				default: '{}',
				description:
					'What the side effect is about. The gateway keeps its fingerprint: the same key with another payload is refused (idempotency_key_reused).',
				displayOptions: show('claim'),
			},
			{
				displayName: 'Lease Seconds',
				name: 'leaseSeconds',
				type: 'number',
				typeOptions: { minValue: 1, maxValue: 3600 },
				default: 60,
				description: 'How long the claim is yours; longer than the side effect takes, or send heartbeats',
				displayOptions: show('claim', 'heartbeat'),
			},
			{
				displayName: 'Wait While Busy',
				name: 'waitWhileBusy',
				type: 'boolean',
				default: true,
				description:
					'Whether to wait the gateway’s Retry-After and claim again while another run holds the key, before sending the item to Busy',
				displayOptions: show('claim'),
			},
			{
				displayName: 'Max Rounds',
				name: 'maxRounds',
				type: 'number',
				typeOptions: { minValue: 1, maxValue: 20 },
				default: BUSY_DEFAULT_ROUNDS,
				description:
					'Claims to retry while busy, at most. With the defaults (2 rounds of 2 s) a duplicate is answered within about 5 s, inside a provider’s webhook timeout.',
				displayOptions: { show: { operation: ['claim'], waitWhileBusy: [true] } },
			},
			{
				displayName: 'Max Wait per Round (Seconds)',
				name: 'maxWaitSeconds',
				type: 'number',
				typeOptions: { minValue: 1, maxValue: 300 },
				default: BUSY_DEFAULT_MAX_WAIT_SECONDS,
				description:
					'Upper bound of one wait; a smaller Retry-After is honoured. The gateway’s Retry-After on a busy key is the lease’s remaining time, not an estimate of the run.',
				displayOptions: { show: { operation: ['claim'], waitWhileBusy: [true] } },
			},

			// ---------------------------------------------------------------- Complete / Fail / Heartbeat
			...LEASE_FIELDS,
			{
				displayName: 'Result',
				name: 'result',
				type: 'json',
				default: '{}',
				description: 'Stored under the key and returned to every later claim (Done output)',
				displayOptions: show('complete'),
			},
			{
				displayName: 'External Reference',
				name: 'externalRef',
				type: 'string',
				default: '',
				description: 'The downstream’s ID for what was created (a task ID, an invoice number)',
				displayOptions: show('complete'),
			},
			{
				displayName: 'Error Code',
				name: 'errorCode',
				type: 'string',
				default: '',
				required: true,
				placeholder: 'crm_http_503',
				description: 'A short code of letters, digits and the characters _ . : - (e.g. crm_http_503).',
				displayOptions: show('fail'),
			},
			{
				displayName: 'Retryable',
				name: 'retryable',
				type: 'boolean',
				default: true,
				description: 'Whether the next claim may try again; otherwise the key ends in a dead letter for an operator',
				displayOptions: show('fail'),
			},
			{
				displayName: 'Effect',
				name: 'effect',
				type: 'options',
				default: 'unknown',
				description: 'Whether the side effect may have happened',
				options: [
					{
						name: 'Unknown',
						value: 'unknown',
						description: 'The answer was lost or the downstream failed: the next claim comes out of Look First',
					},
					{
						name: 'None',
						value: 'none',
						description: 'Nothing was done (the downstream refused, or the request never left)',
					},
				],
				displayOptions: show('fail'),
			},
			{
				displayName: 'Detail',
				name: 'detail',
				type: 'string',
				default: '',
				description: 'Free text for the operator',
				displayOptions: show('fail'),
			},

			// ---------------------------------------------------------------- Send Event
			{
				displayName: 'Envelope',
				name: 'envelope',
				type: 'options',
				default: 'fields',
				options: [
					{ name: 'From Fields Below', value: 'fields' },
					{
						name: 'The Incoming Item',
						value: 'item',
						description: 'The item’s JSON is the envelope (source, event_type, external_ID, payload ...)',
					},
				],
				displayOptions: show('sendEvent'),
			},
			{
				displayName: 'Source',
				name: 'source',
				type: 'string',
				default: '',
				required: true,
				placeholder: 'webform',
				description: 'Who sent the event; a source with a secret must be signed (set the credential’s Signing Secret)',
				displayOptions: { show: { operation: ['sendEvent'], envelope: ['fields'] } },
			},
			{
				displayName: 'Event Type',
				name: 'eventType',
				type: 'string',
				default: '',
				required: true,
				placeholder: 'crm.lead.created',
				description: 'Picks the gateway’s route',
				displayOptions: { show: { operation: ['sendEvent'], envelope: ['fields'] } },
			},
			{
				displayName: 'External ID',
				name: 'externalId',
				type: 'string',
				default: '',
				required: true,
				description: 'The source’s own ID for the event',
				displayOptions: { show: { operation: ['sendEvent'], envelope: ['fields'] } },
			},
			{
				displayName: 'Event Payload',
				name: 'eventPayload',
				type: 'json',
				default: '',
				description:
					'A JSON object, passed to the route’s action. Empty: the webhook’s body when the item comes from a Webhook node (never its headers), else the incoming item.',
				displayOptions: { show: { operation: ['sendEvent'], envelope: ['fields'] } },
			},
			{
				displayName: 'Version',
				name: 'version',
				type: 'string',
				default: '',
				description: 'Tells real changes of one object apart (e.g. updated_at); part of the key',
				displayOptions: { show: { operation: ['sendEvent'], envelope: ['fields'] } },
			},
			{
				displayName: 'Idempotency Key',
				name: 'idempotencyKey',
				type: 'string',
				default: '',
				description:
					'Replaces the key built from the envelope; prefer the provider’s own event ID. Stored in the source’s namespace (source:key, unless it starts with that already); idem.key is the stored key.',
				displayOptions: show('sendEvent'),
			},

			// ---------------------------------------------------------------- every operation
			{
				displayName: 'Options',
				name: 'options',
				type: 'collection',
				placeholder: 'Add option',
				default: {},
				options: [
					{
						displayName: 'Correlation ID',
						name: 'correlationId',
						type: 'string',
						default: '',
						description: 'Traced through the gateway’s logs (claims and events)',
					},
					{
						displayName: 'Timeout (Ms)',
						name: 'timeout',
						type: 'number',
						typeOptions: { minValue: 1 },
						default: DEFAULT_TIMEOUT_MS,
						description: 'How long to wait for the gateway before the call counts as a transport error',
					},
				],
			},
		],
	};

	async execute(this: IExecuteFunctions): Promise<INodeExecutionData[][]> {
		const items = this.getInputData();
		const operation = this.getNodeParameter('operation', 0) as Operation;
		const credentials = (await this.getCredentials('idemApi')) as unknown as IdemCredentials;
		const claiming = operation === 'claim';
		const deduping = operation === 'dedupe';
		const outputs: INodeExecutionData[][] = claiming
			? CLAIM_ROUTES.map(() => [])
			: deduping
				? [[], []]
				: [[]];
		// Items that fail under Continue On Fail go where nothing acts on them (n8n's
		// "Continue (using error output)" then moves them to the error output).
		const errorOutput = claiming ? CLAIM_ROUTES.indexOf('refused') : deduping ? DEDUPE_SEEN : 0;

		for (let index = 0; index < items.length; index++) {
			try {
				if (claiming) {
					const { route, fields } = await claim(this, credentials, index);
					outputs[CLAIM_ROUTES.indexOf(route)].push(withIdem(items[index], fields, index));
					continue;
				}
				const request = buildRequest(this, operation, credentials, index);
				const answer = await send(this, request, index);
				const merged = mergeIdem(items[index].json.idem, answerFields(answer, operation), leaseOf(this, operation, index));
				if (!isRefusal(answer, operation)) {
					const output = deduping && dedupeRoute(answer) === 'seen' ? DEDUPE_SEEN : DEDUPE_NEW;
					outputs[output].push(withIdem(items[index], merged, index));
					continue;
				}
				// A refusal is never a success: it fails the execution, or takes n8n's error output.
				const refused = new NodeApiError(this.getNode(), merged as JsonObject, {
					message: refusalMessage(answer, OPERATION_NAMES[operation]),
					httpCode: String(answer.statusCode),
					itemIndex: index,
				});
				if (!this.continueOnFail()) throw refused;
				outputs[errorOutput].push(failedItem(items[index], merged, refused, index));
			} catch (error) {
				const failure =
					error instanceof IdemInputError
						? new NodeOperationError(this.getNode(), error.message, { itemIndex: index })
						: (error as NodeApiError | NodeOperationError);
				if (this.continueOnFail()) {
					const fields: JsonMap = {
						status: failure instanceof NodeApiError ? 'unavailable' : 'error',
						error: failure instanceof NodeApiError ? 'gateway_unavailable' : 'invalid_parameter',
					};
					const httpStatus = Number((failure as NodeApiError).httpCode);
					if (Number.isInteger(httpStatus) && httpStatus > 0) fields.http_status = httpStatus;
					const merged = mergeIdem(items[index].json.idem, fields, leaseOf(this, operation, index));
					outputs[errorOutput].push(failedItem(items[index], merged, failure, index));
					continue;
				}
				throw failure;
			}
		}
		return outputs;
	}
}

const OPERATION_NAMES: Record<Operation, string> = {
	claim: 'Claim',
	complete: 'Complete',
	fail: 'Fail',
	heartbeat: 'Heartbeat',
	getEvent: 'Get Event',
	sendEvent: 'Send Event',
	dedupe: 'Dedupe',
};

/**
 * An item that failed under On Error → Continue: it keeps its data and `idem` (key and lease
 * token included), says why in `error`, and carries the error itself, which is how n8n's
 * "Continue (using error output)" recognises it and moves it to the error output.
 */
function failedItem(
	item: INodeExecutionData,
	fields: JsonMap,
	error: NodeApiError | NodeOperationError,
	index: number,
): INodeExecutionData {
	return {
		json: { ...item.json, idem: fields as IDataObject, error: error.message },
		error,
		pairedItem: { item: index },
	};
}

/** The item goes on with the gateway's answer under `idem` (the lease token travels there). */
function withIdem(item: INodeExecutionData, fields: JsonMap, index: number): INodeExecutionData {
	return { json: { ...item.json, idem: fields as IDataObject }, pairedItem: { item: index } };
}

/** The key and lease token an operation on a claim used, so they stay on the item. */
function leaseOf(
	context: IExecuteFunctions,
	operation: Operation,
	index: number,
): { key?: string; leaseToken?: string } | undefined {
	if (operation === 'claim' || operation === 'dedupe') return { key: String(context.getNodeParameter('key', index, '') ?? '') };
	if (operation !== 'complete' && operation !== 'fail' && operation !== 'heartbeat') return undefined;
	return claimLease(context, index);
}

/** A parameter's value, '' when its expression cannot be evaluated (`$json.idem` is gone). */
function parameterText(context: IExecuteFunctions, name: string, index: number): string {
	try {
		return String(context.getNodeParameter(name, index, '') ?? '');
	} catch {
		return '';
	}
}

/**
 * The claim Complete, Fail and Heartbeat act on: Key and Lease Token as set, else the claim of
 * the Idem Trigger that started the execution (triggerLease.ts).
 */
function claimLease(context: IExecuteFunctions, index: number): Lease {
	const given = { key: parameterText(context, 'key', index), leaseToken: parameterText(context, 'leaseToken', index) };
	if (given.key && given.leaseToken) return given;
	return leaseToUse(given, triggerClaim(context, index));
}

/**
 * The `idem` of the Idem Trigger's item in this execution: the item this one descends from,
 * else the trigger's first item on either output. Undefined when no Idem Trigger started the
 * execution (a manual run, another trigger).
 */
function triggerClaim(context: IExecuteFunctions, index: number): JsonMap | undefined {
	let names: string[];
	try {
		names = triggerNames(context.getParentNodes(context.getNode().name));
	} catch {
		return undefined;
	}
	for (const name of names) {
		const reads: Array<(node: IDataObject) => unknown> = [
			(node) => node.item,
			(node) => (node.first as (branch?: number) => unknown)(),
			(node) => (node.first as (branch?: number) => unknown)(0),
			(node) => (node.first as (branch?: number) => unknown)(1),
		];
		for (const read of reads) {
			try {
				const proxy = context.getWorkflowDataProxy(index);
				const item = read((proxy.$ as (nodeName: string) => IDataObject)(name)) as { json?: IDataObject } | undefined;
				const idem = item?.json?.idem;
				if (idem && typeof idem === 'object' && !Array.isArray(idem)) return idem as JsonMap;
			} catch {
				// Not this way (no paired item, nothing on that output): try the next one.
			}
		}
	}
	return undefined;
}

function options(context: IExecuteFunctions, index: number): { correlationId?: string; timeout?: number } {
	return context.getNodeParameter('options', index, {}) as { correlationId?: string; timeout?: number };
}

async function claim(
	context: IExecuteFunctions,
	credentials: IdemCredentials,
	index: number,
): Promise<{ route: ClaimRoute; fields: JsonMap }> {
	const key = context.getNodeParameter('key', index) as string;
	const request = claimRequest(credentials, {
		key,
		payload: jsonParameter(context.getNodeParameter('payload', index, '{}'), 'Payload'),
		leaseSeconds: context.getNodeParameter('leaseSeconds', index, 60) as number,
		workflow: context.getWorkflow().name,
		correlationId: options(context, index).correlationId,
	});
	const waitWhileBusy = context.getNodeParameter('waitWhileBusy', index, true) as boolean;
	const maxRounds = waitWhileBusy ? (context.getNodeParameter('maxRounds', index, BUSY_DEFAULT_ROUNDS) as number) : 0;
	const maxWait = context.getNodeParameter('maxWaitSeconds', index, BUSY_DEFAULT_MAX_WAIT_SECONDS) as number;

	let answer = await send(context, request, index);
	let route = claimRoute(answer);
	let rounds = 0;
	while (route === 'busy' && rounds < maxRounds) {
		await sleep(busyWaitSeconds(answer, maxWait) * 1000);
		answer = await send(context, request, index);
		route = claimRoute(answer);
		rounds++;
	}
	const fields: JsonMap = { key, ...answerFields(answer, 'claim'), outcome: route };
	if (rounds) fields.busy_rounds = rounds;
	return { route, fields };
}

function buildRequest(
	context: IExecuteFunctions,
	operation: Exclude<Operation, 'claim'>,
	credentials: IdemCredentials,
	index: number,
): GatewayRequest {
	const parameter = (name: string, fallback?: unknown) => context.getNodeParameter(name, index, fallback);
	switch (operation) {
		case 'complete':
			return completeRequest(credentials, {
				...claimLease(context, index),
				result: jsonParameter(parameter('result', '{}'), 'Result'),
				externalRef: parameter('externalRef', '') as string,
			});
		case 'fail':
			return failRequest(credentials, {
				...claimLease(context, index),
				errorCode: parameter('errorCode') as string,
				retryable: parameter('retryable', true) as boolean,
				effect: parameter('effect', 'unknown') as Effect,
				detail: parameter('detail', '') as string,
			});
		case 'heartbeat':
			return heartbeatRequest(credentials, {
				...claimLease(context, index),
				leaseSeconds: parameter('leaseSeconds', 60) as number,
			});
		case 'dedupe':
			return dedupeRequest(credentials, {
				key: parameter('key') as string,
				ttlSeconds: parameter('ttlSeconds', 86_400),
				workflow: context.getWorkflow().name,
				correlationId: options(context, index).correlationId,
			});
		case 'getEvent':
			return getEventRequest(credentials, parameter('key') as string);
		case 'sendEvent': {
			const envelope =
				parameter('envelope', 'fields') === 'item'
					? (context.getInputData()[index].json as Record<string, unknown>)
					: envelopeFromFields({
							source: parameter('source') as string,
							eventType: parameter('eventType') as string,
							externalId: parameter('externalId') as string,
							payload: eventPayload(parameter('eventPayload', ''), context.getInputData()[index].json),
							version: parameter('version', '') as string,
							correlationId: options(context, index).correlationId,
							workflow: context.getWorkflow().name,
							executionId: context.getExecutionId(),
						});
			return sendEventRequest(
				credentials,
				{ envelope, idempotencyKey: parameter('idempotencyKey', '') as string },
				Date.now() / 1000,
			);
		}
	}
}

/** Event Payload as set, else the default from the incoming item (see defaultEventPayload). */
function eventPayload(value: unknown, itemJson: unknown): Json | undefined {
	const blank = value === undefined || value === null || (typeof value === 'string' && value.trim() === '');
	return blank ? defaultEventPayload(itemJson) : jsonParameter(value, 'Event Payload');
}

/**
 * One request. No answer, or an answer that concludes nothing (408, 429, 5xx), is thrown as a
 * NodeApiError, so n8n's Retry On Fail repeats it and its error output catches what remains.
 */
async function send(context: IExecuteFunctions, request: GatewayRequest, index: number): Promise<GatewayAnswer> {
	let response: { statusCode: number; headers: Record<string, unknown>; body: unknown };
	try {
		response = await context.helpers.httpRequest({
			method: request.method,
			url: request.url,
			headers: request.headers,
			body: request.body,
			json: false,
			encoding: 'text',
			returnFullResponse: true,
			ignoreHttpStatusErrors: true,
			timeout: options(context, index).timeout || DEFAULT_TIMEOUT_MS,
		});
	} catch (error) {
		throw new NodeApiError(context.getNode(), error as JsonObject, {
			message: `The gateway did not answer: ${(error as Error).message}`,
			itemIndex: index,
		});
	}
	const answer: GatewayAnswer = {
		statusCode: response.statusCode,
		headers: { ...response.headers },
		body: response.body,
	};
	if (isUnavailable(answer.statusCode)) {
		throw new NodeApiError(context.getNode(), answerFields(answer) as JsonObject, {
			message: unavailableMessage(answer),
			httpCode: String(answer.statusCode),
			itemIndex: index,
		});
	}
	return answer;
}
