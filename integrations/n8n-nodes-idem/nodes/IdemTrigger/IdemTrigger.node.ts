import type {
	IDataObject,
	INodeType,
	INodeTypeDescription,
	IWebhookFunctions,
	IWebhookResponseData,
} from 'n8n-workflow';

import { claimRequest, parseBody, type GatewayAnswer, type IdemCredentials } from '../Idem/protocol';
import {
	DEFAULT_LEASE_SECONDS,
	claimKeyFor,
	splitSecrets,
	triggerAction,
	triggerItem,
	verifyDelivery,
	type Reply,
} from './trigger';

// A claim answers within seconds or the gateway is unreachable: then the delivery is answered
// 503 and the gateway sends it again later.
const CLAIM_TIMEOUT_MS = 10_000;

interface TriggerCredentials extends IdemCredentials {
	deliverySigningSecret?: string;
}

/**
 * Starts one execution per gateway key however often the gateway sends it. The delivery's
 * Standard Webhooks signature is checked (401, nothing started, when it is wrong), then the key
 * is claimed through the gateway's claims API: claimed starts the execution, a key whose
 * execution still runs is answered 409 in_progress (the gateway waits and asks again without
 * spending an attempt), a finished one is answered with its stored result. The gateway gets
 * the workflow's answer when its last node finishes: end the workflow with the Idem node's
 * Complete, which records the result under the claim.
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
		outputs: ['main'],
		credentials: [{ name: 'idemApi', required: true }],
		webhooks: [
			{
				name: 'default',
				httpMethod: 'POST',
				// The gateway gets the workflow's answer: the last node's first item, once it ran.
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
					'End the workflow with the Idem node’s Complete (Key and Lease Token from this trigger’s item): the gateway receives the last node’s output, and the key’s re-sends are answered from the claim.',
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
		let answer: GatewayAnswer | undefined;
		try {
			const response = await this.helpers.httpRequest({
				method: claim.method,
				url: claim.url,
				headers: claim.headers,
				body: claim.body,
				json: false,
				encoding: 'text',
				returnFullResponse: true,
				ignoreHttpStatusErrors: true,
				timeout: CLAIM_TIMEOUT_MS,
			});
			answer = { statusCode: response.statusCode, headers: { ...response.headers }, body: response.body };
		} catch {
			answer = undefined;
		}
		const action = triggerAction(answer);
		if (!action.start) return reply(action.reply);
		const item = triggerItem({
			event,
			gatewayKey,
			claimKey,
			claim: action.idem,
			correlationId,
		});
		return { workflowData: [[{ json: item as IDataObject }]] };
	}
}
