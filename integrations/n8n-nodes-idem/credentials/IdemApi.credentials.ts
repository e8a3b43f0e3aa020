import type { ICredentialTestRequest, ICredentialType, INodeProperties } from 'n8n-workflow';

/**
 * Where the gateway is and the secrets it asks for. The node builds every header itself (the
 * claims token for /v1/claims, the claims or operator token for event look-ups, the HMAC
 * signature for /v1/events), so the secrets never appear in a workflow or its executions.
 */
/** A key no event has: looking it up changes nothing. */
export const CREDENTIAL_TEST_KEY = 'n8n-credential-test';

// The gateway is self-hosted: its docs (docs/how-to/n8n.md) ship with it, at no public URL.
// eslint-disable-next-line n8n-nodes-base/cred-class-field-documentation-url-missing
export class IdemApi implements ICredentialType {
	name = 'idemApi';

	displayName = 'Idem API';

	properties: INodeProperties[] = [
		{
			displayName: 'Base URL',
			name: 'baseUrl',
			type: 'string',
			default: 'http://localhost:8000',
			placeholder: 'https://idem.example.com',
			description: 'The gateway receiver, without a trailing /v1',
			required: true,
		},
		{
			displayName: 'Claims Token',
			name: 'claimsToken',
			type: 'string',
			typeOptions: { password: true },
			default: '',
			description:
				"The gateway's CLAIMS_TOKEN, sent as a Bearer token on every claims call and event look-up. Leave empty only when the gateway runs on the same machine without one.",
		},
		{
			displayName: 'Operator Token',
			name: 'operatorToken',
			type: 'string',
			typeOptions: { password: true },
			default: '',
			description: "The gateway's OPERATOR_TOKEN: used by Get Event when no claims token is set",
		},
		{
			displayName: 'Signing Secret',
			name: 'signingSecret',
			type: 'string',
			typeOptions: { password: true },
			default: '',
			description:
				"The source's secret from the gateway's WEBHOOK_SECRETS: Send Event signs its requests with it (X-Idem-Signature v2). Leave empty for unsigned sources.",
		},
		{
			displayName: 'Delivery Signing Secret',
			name: 'deliverySigningSecret',
			type: 'string',
			typeOptions: { password: true },
			default: '',
			placeholder: 'whsec_…',
			description:
				"The signing_secret of the gateway route that calls an Idem Trigger (Standard Webhooks, whsec_…; several separated by spaces during a rotation). The trigger refuses deliveries it does not verify.",
		},
	];

	// The claims token against an endpoint that requires it and changes nothing: the look-up
	// of a key no event has. The gateway answers 404 key_not_found to a good token, 401
	// unauthorized to a wrong one, 403 claims_forbidden when it has no token and the caller is
	// not on its machine. Every status is taken as an answer (ignoreHttpStatusErrors) and the
	// rules turn the refusals into a failed test: n8n would fail a 404 by default.
	test: ICredentialTestRequest = {
		request: {
			baseURL: '={{$credentials.baseUrl.replace(/\\/+$/, "")}}',
			url: `/v1/events/${CREDENTIAL_TEST_KEY}`,
			method: 'GET',
			headers: {
				Accept: 'application/json',
				Authorization: '={{$credentials.claimsToken ? "Bearer " + $credentials.claimsToken : ""}}',
			},
			ignoreHttpStatusErrors: true,
		},
		rules: [
			{
				type: 'responseSuccessBody',
				properties: {
					key: 'error',
					value: 'unauthorized',
					message: 'The gateway refused the claims token (401): check the credential’s Claims Token against CLAIMS_TOKEN',
				},
			},
			{
				type: 'responseSuccessBody',
				properties: {
					key: 'error',
					value: 'claims_forbidden',
					message: 'The gateway has no CLAIMS_TOKEN and serves only its own machine (403): set CLAIMS_TOKEN there and here',
				},
			},
			{
				type: 'responseSuccessBody',
				properties: {
					key: 'error',
					value: 'too_many_failures',
					message: 'The gateway refuses this address for a while after too many wrong tokens (429): try again later',
				},
			},
		],
	};
}
