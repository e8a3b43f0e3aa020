// Copies the nodes' and credentials' SVG icons next to the compiled files (tsc copies only .ts).
const fs = require('fs');
const path = require('path');

const root = path.resolve(__dirname, '..');
for (const folder of ['nodes', 'credentials']) {
	const source = path.join(root, folder);
	if (!fs.existsSync(source)) continue;
	for (const entry of fs.readdirSync(source, { recursive: true })) {
		if (!String(entry).endsWith('.svg')) continue;
		const target = path.join(root, 'dist', folder, String(entry));
		fs.mkdirSync(path.dirname(target), { recursive: true });
		fs.copyFileSync(path.join(source, String(entry)), target);
	}
}
