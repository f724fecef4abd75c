// Drives Debian's chromium for tests/dashboard.rs: loads the dashboard,
// then runs the steps the Rust test sends, one JSON object per stdin line,
// answering each with one JSON line on stdout. Every wait is on a page
// condition with a timeout; nothing sleeps.
//
//   node dashboard.mjs URL
//   NEWSNACK_BROWSER_PASSWORD (and NEWSNACK_BROWSER_USER): answer the
//   server's HTTP authentication challenge with them, as a person would
//   at the browser's prompt. A page that does not load is answered
//   {"ok": true, "loaded": false, "status": 401} and ends the run.
//   step:   {"counts": {"PENDING": 3, ...}, "row": {"issue": 7, "to": "IN_PROGRESS"},
//            "claim": 7, "screenshot": "/path/x.png"}   (every key optional)
//   answer: {"ok": true, "counts": {...}, "stats": {...}} or {"ok": false, "error": ".."}
import { createInterface } from "node:readline";
import { chromium } from "playwright-core";

const url = process.argv[2];
const executablePath = process.env.NEWSNACK_CHROMIUM || "/usr/bin/chromium";
const TIMEOUT_MS = Number(process.env.NEWSNACK_BROWSER_TIMEOUT_MS || 20000);
const say = (value) => process.stdout.write(JSON.stringify(value) + "\n");

const browser = await chromium.launch({
  executablePath,
  headless: true,
  args: [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",
  ],
});
const password = process.env.NEWSNACK_BROWSER_PASSWORD;
const httpCredentials =
  password === undefined ? undefined : { username: process.env.NEWSNACK_BROWSER_USER || "", password };
const context = await browser.newContext({ viewport: { width: 1440, height: 1000 }, httpCredentials });
const page = await context.newPage();
page.setDefaultTimeout(TIMEOUT_MS);
const errors = [];
page.on("pageerror", (e) => errors.push(String(e)));
page.on("console", (m) => m.type() === "error" && errors.push(`${m.text()} (${m.location().url})`));

const counts = () =>
  page.evaluate(() =>
    Object.fromEntries(
      [...document.querySelectorAll("[id^=count-]")].map((n) => [n.id.slice(6), n.dataset.count])
    )
  );
const report = async (extra) => ({
  ...extra,
  counts: await counts(),
  live: await page.evaluate(() => document.body.dataset.live),
  stats: await page.evaluate(() => window.newsnackDashboard && window.newsnackDashboard.stats),
  errors,
});

async function step(s) {
  if (s.counts) {
    const want = Object.fromEntries(Object.entries(s.counts).map(([k, v]) => [k, String(v)]));
    await page.waitForFunction(
      (want) => Object.entries(want).every(([k, v]) => document.getElementById("count-" + k)?.dataset.count === v),
      want,
    );
  }
  if (s.live) await page.waitForFunction(() => document.body.dataset.live === "live");
  if (s.row) {
    await page.waitForSelector(
      `#transitions li[data-issue="${s.row.issue}"][data-to="${s.row.to}"][data-via="stream"]`,
    );
  }
  if (s.claim) await page.waitForSelector(`#claims tr[data-issue="${s.claim}"]`);
  if (s.selector) await page.waitForSelector(s.selector);
  if (s.screenshot) await page.screenshot({ path: s.screenshot, fullPage: true });
}

try {
  // The status of the page itself, also when Chromium gives up on a
  // challenge it has no answer for (a person dismissing the prompt).
  let documentStatus = null;
  page.on("response", (r) => r.request().isNavigationRequest() && (documentStatus = r.status()));
  const response = await page.goto(url).catch((e) => {
    if (String(e).includes("ERR_INVALID_AUTH_CREDENTIALS") && documentStatus !== null) return null;
    throw e;
  });
  const status = response === null ? documentStatus : response.status();
  if (status < 200 || status > 299) {
    // The browser's own note of the refusal is expected; nothing else.
    const others = errors.filter((e) => !e.includes(`status of ${status}`));
    say({ ok: true, loaded: false, status, errors: others });
    await browser.close();
    process.exit(0);
  }
  await page.waitForFunction(() => document.body.dataset.ready === "1");
  // Marks this document: a reload would lose it.
  await page.evaluate(() => (window.__sameDocument = true));
  say(await report({ ok: true, loaded: true }));
} catch (e) {
  say({ ok: false, error: String(e), errors });
  await browser.close();
  process.exit(1);
}

for await (const line of createInterface({ input: process.stdin })) {
  if (!line.trim()) continue;
  try {
    await step(JSON.parse(line));
    const sameDocument = await page.evaluate(() => window.__sameDocument === true);
    say(await report({ ok: true, sameDocument }));
  } catch (e) {
    say(await report({ ok: false, error: String(e) }).catch(() => ({ ok: false, error: String(e), errors })));
  }
}
await browser.close();
