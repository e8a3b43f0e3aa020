// n8n's node linter (eslint-plugin-n8n-nodes-base): the rules for community packages, for
// credentials and for nodes, as n8n's node starter applies them.
const tsParser = require('@typescript-eslint/parser');
const n8nNodesBase = require('eslint-plugin-n8n-nodes-base');

const plugins = { 'n8n-nodes-base': n8nNodesBase };

module.exports = [
	{ ignores: ['dist/**', 'node_modules/**', 'scripts/**', 'test/**', 'eslint.config.js'] },
	{
		files: ['package.json'],
		languageOptions: { parser: tsParser, parserOptions: { extraFileExtensions: ['.json'] } },
		plugins,
		rules: n8nNodesBase.configs.community.rules,
	},
	{
		files: ['credentials/**/*.ts'],
		languageOptions: { parser: tsParser, parserOptions: { sourceType: 'module' } },
		plugins,
		rules: n8nNodesBase.configs.credentials.rules,
	},
	{
		files: ['nodes/**/*.ts'],
		languageOptions: { parser: tsParser, parserOptions: { sourceType: 'module' } },
		plugins,
		rules: n8nNodesBase.configs.nodes.rules,
	},
];
