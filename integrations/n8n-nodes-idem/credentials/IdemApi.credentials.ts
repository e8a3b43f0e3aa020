import type { ICredentialTestRequest, ICredentialType, INodeProperties } from 'n8n-workflow';

/**
 * Where the gateway is and the secrets it asks for. The node builds every header itself (the
 * claims token for /v1/claims, the claims or operator token for event look-ups, the HMAC
 * signature for /v1/events), so the secrets never appear in a workflow or its executions.
 */
// The gateway is self-hosted: its docs (docs/n8n.md) ship with it, at no public URL.
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
	];

	// Reachability only: every gateway answer to a token is specific to a key.
	test: ICredentialTestRequest = {
		request: {
			baseURL: '={{$credentials.baseUrl.replace(/\\/+$/, "")}}',
			url: '/healthz',
		},
	};
}
