import type {
	IDataObject,
	INodeExecutionData,
	INodeType,
	INodeTypeDescription,
	IWebhookFunctions,
	IWebhookResponseData,
} from 'n8n-workflow';

import {
	claimRequest,
	parseBody,
	type GatewayAnswer,
	type GatewayRequest,
	type IdemCredentials,
} from '../Idem/protocol';
import { answerAfterRun, type Call, type RunAnswer } from './afterRun';
import {
	DEFAULT_LEASE_SECONDS,
	TRIGGER_OUTPUT_NAMES,
	claimKeyFor,
	splitSecrets,
	triggerAction,
	triggerItem,
	triggerOutput,
	verifyDelivery,
	type Reply,
} from './trigger';

// A claim answers within seconds or the gateway is unreachable: then the delivery is answered
// 503 and the gateway sends it again later.
const CLAIM_TIMEOUT_MS = 10_000;

interface TriggerCredentials extends IdemCredentials {
	deliverySigningSecret?: string;
}

type WebhookResponse = ReturnType<IWebhookFunctions['getResponseObject']>;

/**
 * n8n answers the webhook once the last node finishes, through the response object (its
 * `json`, or `send` for a text body). The trigger takes that answer over: `decide` turns it
 * into the claim's outcome and the answer the gateway gets. Anything n8n sends after the first
 * answer is dropped (there is none in n8n 2.x).
 */
function answerWhenRunEnds(response: WebhookResponse, decide: (run: RunAnswer) => Promise<Reply>): void {
	const json = response.json.bind(response);
	const send = response.send.bind(response);
	let taken = false;
	const take = (body: unknown): WebhookResponse => {
		if (taken) return response;
		taken = true;
		response.json = json;
		response.send = send;
		const run: RunAnswer = { statusCode: response.statusCode, body };
		void decide(run)
			.catch(
				(): Reply => ({
					statusCode: 502,
					body: { idem: 'unavailable', error: 'trigger_error' },
					headers: { 'Retry-After': '5' },
				}),
			)
			.then((reply) => {
				if (response.headersSent) return;
				response.status(reply.statusCode);
				for (const [name, value] of Object.entries(reply.headers)) response.setHeader(name, value);
				json(reply.body);
			});
		return response;
	};
	response.json = ((body: unknown) => take(body)) as WebhookResponse['json'];
	response.send = ((body: unknown) =>
		take(typeof body === 'string' || Buffer.isBuffer(body) ? parseBody(body) : body)) as WebhookResponse['send'];
}

/**
 * Starts one execution per gateway key however often the gateway sends it. The delivery's
 * Standard Webhooks signature is checked (401, nothing started, when it is wrong), then the key
 * is claimed through the gateway's claims API: claimed starts the execution (on Look First when
 * an earlier one may have acted), a key whose execution still runs is answered 409 in_progress
 * (the gateway waits and asks again without spending an attempt), a finished one is answered
 * with its stored result. When the execution ends the trigger records its outcome under the
 * claim (afterRun.ts) and answers the gateway the same result a re-send would get.
 */
export class IdemTrigger implements INodeType {
	description: INodeTypeDescription = {
		displayName: 'Idem Trigger',
		name: 'idemTrigger',
		icon: 'file:idem.svg',
		group: ['trigger'],
		version: 1,
		subtitle: '={{"POST /webhook/" + $parameter["path"]}}',
		description: 'Starts one execution per idem gateway delivery key, however often the gateway sends it',
		eventTriggerDescription: 'Waiting for a delivery from the idem gateway',
		activationMessage: 'Point a gateway route with signing_secret at the production URL.',
		defaults: { name: 'Idem Trigger' },
		inputs: [],
		outputs: TRIGGER_OUTPUT_NAMES.map((displayName) => ({ type: 'main', displayName })),
		credentials: [{ name: 'idemApi', required: true }],
		webhooks: [
			{
				name: 'default',
				httpMethod: 'POST',
				// The execution's end is taken over by the trigger (answerWhenRunEnds): it records
				// the last node's first item, or the failure, under the claim, then answers.
				responseMode: 'lastNode',
				responseData: 'firstEntryJson',
				path: '={{$parameter["path"]}}',
				// /webhook/<path>, as the Webhook node: not /webhook/<id>/<node>/<path>.
				isFullPath: true,
			},
		],
		properties: [
			{
				displayName: 'Path',
				name: 'path',
				type: 'string',
				default: 'idem',
				required: true,
				description: 'The webhook path: the gateway route’s URL is the production URL shown above',
			},
			{
				displayName: 'Lease Seconds',
				name: 'leaseSeconds',
				type: 'number',
				typeOptions: { minValue: 1, maxValue: 3600 },
				default: DEFAULT_LEASE_SECONDS,
				description:
					'How long the execution holds the key. Keep it above the workflow’s longest run: when it expires, the next delivery starts another execution (marked uncertain).',
			},
			{
				displayName:
					'When the workflow ends, the trigger completes its claim with the last node’s output (without its idem member) and the gateway gets that result; an Idem Complete in the workflow (its Key and Lease Token at their defaults find this trigger’s claim) records its own Result instead. A failed workflow frees the claim for a retry. Connect Look First: a re-run after an earlier execution that may have acted comes out there.',
				name: 'notice',
				type: 'notice',
				default: '',
			},
		],
	};

	async webhook(this: IWebhookFunctions): Promise<IWebhookResponseData> {
		const credentials = (await this.getCredentials('idemApi')) as unknown as TriggerCredentials;
		const request = this.getRequestObject() as ReturnType<IWebhookFunctions['getRequestObject']> & {
			rawBody?: Buffer;
		};
		const headers = this.getHeaderData() as IDataObject;
		const text = (name: string) => (typeof headers[name] === 'string' ? (headers[name] as string) : undefined);
		const reply = (answer: Reply): IWebhookResponseData => {
			const response = this.getResponseObject();
			for (const [name, value] of Object.entries(answer.headers)) response.setHeader(name, value);
			response.status(answer.statusCode).json(answer.body);
			return { noWebhookResponse: true };
		};

		const secrets = splitSecrets(credentials.deliverySigningSecret);
		if (secrets.length === 0) {
			return reply({
				statusCode: 500,
				body: { idem: 'misconfigured', error: 'The Idem API credential has no Delivery Signing Secret' },
				headers: {},
			});
		}
		const body = request.rawBody ?? Buffer.from(JSON.stringify(this.getBodyData() ?? {}), 'utf8');
		let verdict;
		try {
			verdict = verifyDelivery(
				secrets,
				{ id: text('webhook-id'), timestamp: text('webhook-timestamp'), signature: text('webhook-signature'), body },
				Date.now() / 1000,
			);
		} catch (error) {
			verdict = { ok: false as const, reason: (error as Error).message };
		}
		if (!verdict.ok) {
			return reply({ statusCode: 401, body: { idem: 'invalid_signature', error: verdict.reason }, headers: {} });
		}

		const gatewayKey = text('webhook-id') as string;
		const claimKey = claimKeyFor(gatewayKey);
		const event = parseBody(body.toString('utf8'));
		const correlationId = text('x-correlation-id');
		const leaseSeconds = this.getNodeParameter('leaseSeconds', DEFAULT_LEASE_SECONDS) as number;
		const claim = claimRequest(credentials, {
			key: claimKey,
			// The same bytes on every re-send; another payload under the key is refused (422).
			payload: event,
			leaseSeconds,
			workflow: this.getWorkflow().name,
			correlationId,
		});
		const call: Call = async (one: GatewayRequest) => {
			try {
				const response = await this.helpers.httpRequest({
					method: one.method,
					url: one.url,
					headers: one.headers,
					body: one.body,
					json: false,
					encoding: 'text',
					returnFullResponse: true,
					ignoreHttpStatusErrors: true,
					timeout: CLAIM_TIMEOUT_MS,
				});
				return { statusCode: response.statusCode, headers: { ...response.headers }, body: response.body };
			} catch {
				return undefined;
			}
		};
		const answer: GatewayAnswer | undefined = await call(claim);
		const action = triggerAction(answer);
		if (!action.start) return reply(action.reply);
		const item = triggerItem({
			event,
			gatewayKey,
			claimKey,
			claim: action.idem,
			correlationId,
		});
		const leaseToken = String(action.idem.lease_token ?? '');
		answerWhenRunEnds(this.getResponseObject(), async (run) =>
			answerAfterRun(run, { credentials, key: claimKey, leaseToken }, call),
		);
		const outputs: INodeExecutionData[][] = TRIGGER_OUTPUT_NAMES.map(() => []);
		outputs[triggerOutput(action.idem)].push({ json: item as IDataObject });
		return { workflowData: outputs };
	}
}
