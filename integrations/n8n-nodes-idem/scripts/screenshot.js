// The editor's view of one workflow, as a PNG, from a running n8n, in headless Chromium.
//
//   node scripts/screenshot.js <n8n URL> <workflow id> <out.png>
//
// Needs `playwright-core` on NODE_PATH (it is not a dependency of the package) and Chromium
// (CHROMIUM, default /usr/bin/chromium). Sets up the n8n owner on a fresh instance, or logs in
// as that owner. tests/n8n_e2e/screenshot.py runs it against the end-to-end check's n8n.
const { chromium } = require('playwright-core');

const OWNER = {
	email: 'owner@example.com',
	firstName: 'Ada',
	lastName: 'Owner',
	password: 'Screenshot-0wner',
};

async function main() {
	const [url, workflowId, out] = process.argv.slice(2);
	if (!url || !workflowId || !out) {
		throw new Error('usage: node scripts/screenshot.js <n8n URL> <workflow id> <out.png>');
	}
	const browser = await chromium.launch({
		executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
		args: ['--no-sandbox', '--disable-dev-shm-usage'],
	});
	try {
		const context = await browser.newContext({ viewport: { width: 1680, height: 880 }, deviceScaleFactor: 1 });
		const page = await context.newPage();
		let signedIn = await page.request.post(`${url}/rest/owner/setup`, { data: OWNER });
		if (!signedIn.ok()) {
			signedIn = await page.request.post(`${url}/rest/login`, {
				data: { emailOrLdapLoginId: OWNER.email, password: OWNER.password },
			});
		}
		if (!signedIn.ok()) throw new Error(`n8n sign-in failed: ${signedIn.status()} ${await signedIn.text()}`);
		await page.goto(`${url}/workflow/${workflowId}`, { waitUntil: 'networkidle' });
		await page.waitForSelector('[data-test-id="canvas-node"]', { timeout: 60_000 });
		// "1" is n8n's zoom-to-fit shortcut (the canvas also fits the view when it opens).
		await page.keyboard.press('1');
		await page.waitForTimeout(1500);
		await page.screenshot({ path: out });
	} finally {
		await browser.close();
	}
}

main().catch((error) => {
	console.error(error);
	process.exit(1);
});
