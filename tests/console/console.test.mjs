// Browser tests of the web console (/console/), driven by playwright-core
// against Debian's Chromium (no browser download), following the page
// contract of the console (ids, routes, form fields). tests/e2e/console.rs
// starts a sandbox and runs this script; `make browser` installs what it
// needs (chromium, chromium-driver, and `npm ci` here).
//
// Flows:
//   operator        sign in, create an account (its first ADMIN key), credit
//                   it $1 (the same form twice credits once), create an
//                   INFERENCE key, chat with it, see the usage in the chart
//                   data and the table and the balance drop, revoke the key,
//                   see the next chat refused (401); every operator page.
//   account holder  sign in with that ADMIN key: overview, usage (chart data,
//                   CSV download), keys (create one with a USD cap, its secret
//                   shown once, revoke it), limits.
//   wallet          an injected EIP-1193 provider (window.ethereum) signing
//                   with viem in node: Sign-In-With-X, then the account pages.
// On every page: axe-core (no serious or critical violation), the page
// contract's landmarks, no Content-Security-Policy violation or script
// error, a full-page screenshot (OUT_DIR/<name>.png) and, once, a phone
// viewport (390x844) without horizontal overflow.
//
// Environment:
//   RIALTO_URL      the gateway, e.g. http://127.0.0.1:41234 (required)
//   OPERATOR_TOKEN  the operator token (required)
//   OUT_DIR         where screenshots and axe-report.json go (required)
//   WALLET_KEY      hex private key of the wallet flow's EVM account (required)
//   CHROMIUM        the browser (default /usr/bin/chromium)
//   CHAT_MODEL      a priced chat model of the gateway (default mock-chat)
//   ACCOUNT_NAME    the account the operator creates (default Acme Research)
//   CONSOLE_FLOWS   comma-separated subset of operator,holder,wallet (default all;
//                   holder needs operator)
//   HEADED=1        show the browser (needs a display)
//   CONSOLE_DEBUG_REQUESTS=1  print the headers of every request but GETs
//
// Exits 0 when every check passed, 1 otherwise (each failure is printed
// with the page it happened on).

import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';
import { privateKeyToAccount } from 'viem/accounts';

const here = path.dirname(fileURLToPath(import.meta.url));

function required(name) {
  const value = process.env[name];
  if (!value) {
    console.error(`console.test.mjs: the environment variable ${name} is required`);
    process.exit(2);
  }
  return value;
}

const BASE = required('RIALTO_URL').replace(/\/+$/, '');
const OPERATOR_TOKEN = required('OPERATOR_TOKEN');
const OUT_DIR = required('OUT_DIR');
const WALLET_KEY = required('WALLET_KEY');
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const CHAT_MODEL = process.env.CHAT_MODEL || 'mock-chat';
const FLOWS = (process.env.CONSOLE_FLOWS || 'operator,holder,wallet').split(',').map((f) => f.trim());
const AXE_PATH = path.join(here, 'node_modules', 'axe-core', 'axe.min.js');
const DESKTOP = { width: 1280, height: 800 };
const PHONE = { width: 390, height: 844 };
// Horizontal overflow at the phone viewport is reported; past this many
// pixels the page is clearly broken and the test fails.
const OVERFLOW_FAIL_PX = 100;
const CSP =
  "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; " +
  "frame-ancestors 'none'; form-action 'self'; base-uri 'none'";

if (!fs.existsSync(CHROMIUM)) {
  console.error(`console.test.mjs: ${CHROMIUM} is missing: run make browser`);
  process.exit(2);
}
if (!fs.existsSync(AXE_PATH)) {
  console.error(`console.test.mjs: ${AXE_PATH} is missing: run make browser`);
  process.exit(2);
}
fs.mkdirSync(OUT_DIR, { recursive: true });
const AXE_SOURCE = fs.readFileSync(AXE_PATH, 'utf8');

/** Failures that do not stop the flow (accessibility, layout, contract details). */
const problems = [];
/** Every page's axe results (all impacts), written to OUT_DIR/axe-report.json. */
const axeReport = [];
const screenshots = [];

class Failure extends Error {}

function check(condition, message) {
  if (!condition) throw new Failure(message);
}

function problem(page, message) {
  const where = page ? ` [${page}]` : '';
  problems.push(`${message}${where}`);
  console.log(`  ✗ ${message}`);
}

function note(message) {
  console.log(`  · ${message}`);
}

function pathOf(url) {
  const u = new URL(url);
  return u.pathname + u.search;
}

/** A decimal shown as text (`10`, `9.99985`, `$0.99`): its value. */
function decimal(text) {
  const cleaned = String(text ?? '').replace(/[^0-9.\-]/g, '');
  const value = Number.parseFloat(cleaned);
  return Number.isFinite(value) ? value : NaN;
}

async function sleep(ms) {
  await new Promise((resolve) => setTimeout(resolve, ms));
}

/** Polls `probe` until it returns a truthy value, for at most `ms`. */
async function eventually(what, probe, ms = 20000) {
  const deadline = Date.now() + ms;
  let last;
  for (;;) {
    last = await probe();
    if (last) return last;
    if (Date.now() > deadline) throw new Failure(`never: ${what}`);
    await sleep(500);
  }
}

/** Everything a page does wrong behind the scenes: CSP violations, script errors. */
function watch(page, label) {
  page.on('dialog', (dialog) => dialog.accept().catch(() => {}));
  page.on('console', (message) => {
    const text = message.text();
    if (/Content Security Policy|Refused to (execute|load|apply|connect|frame)/i.test(text)) {
      problem(pathOf(page.url()), `${label}: Content-Security-Policy violation: ${text}`);
    } else if (message.type() === 'error' && !/Failed to load resource: the server responded with a status of (401|403|404)/.test(text)) {
      note(`${label}: console error on ${pathOf(page.url())}: ${text}`);
    }
  });
  if (process.env.CONSOLE_DEBUG_REQUESTS === '1') {
    page.on('request', async (request) => {
      if (request.method() !== 'GET') {
        note(`${label}: ${request.method()} ${pathOf(request.url())} ${JSON.stringify(await request.allHeaders())}`);
      }
    });
  }
  page.on('pageerror', (error) => {
    problem(pathOf(page.url()), `${label}: script error: ${error.message}`);
  });
}

async function newContext(browser, label) {
  const context = await browser.newContext({ viewport: DESKTOP, locale: 'en-US', colorScheme: 'light' });
  context.setDefaultTimeout(15000);
  context.setDefaultNavigationTimeout(20000);
  context.label = label;
  return context;
}

async function newPage(context) {
  const page = await context.newPage();
  watch(page, context.label);
  return page;
}

/** The alert and status messages on the page, for failure messages. */
async function messages(page) {
  const texts = await page
    .locator('[role=alert], [role=status]')
    .allInnerTexts()
    .catch(() => []);
  return texts.map((t) => t.trim()).filter(Boolean).join(' | ');
}

/** GET `route` in `page`, expecting a 200 page. */
async function open(page, route) {
  const response = await page.goto(BASE + route, { waitUntil: 'load' });
  check(response, `GET ${route}: no response`);
  check(
    response.status() === 200,
    `GET ${route}: ${response.status()} (ended at ${pathOf(page.url())}) ${await messages(page)}`,
  );
  return response;
}

/**
 * Submits `formSelector` by clicking its submit button and waits for the
 * page it leads to; returns that page's response (after redirects).
 */
async function submit(page, formSelector) {
  const form = page.locator(formSelector);
  check((await form.count()) === 1, `${pathOf(page.url())}: no single ${formSelector}`);
  await reveal(page, formSelector);
  const button = form.locator('button[type=submit], input[type=submit], button:not([type])').first();
  check((await button.count()) === 1, `${pathOf(page.url())}: ${formSelector} has no submit button`);
  const [response] = await Promise.all([page.waitForNavigation({ waitUntil: 'load' }), button.click()]);
  return response;
}

/** Opens the collapsed <details> a form is in, as a user would (its summary). */
async function reveal(page, formSelector) {
  const closed = page.locator(`details:not([open]):has(${formSelector}) > summary`);
  for (let i = await closed.count(); i > 0; i--) {
    await closed.first().click();
  }
}

/** Sets a form field whatever its kind (input, textarea, select, radios). */
async function setField(page, formSelector, name, value, { optional = false } = {}) {
  await reveal(page, formSelector);
  const field = page.locator(`${formSelector} [name="${name}"]`);
  const count = await field.count();
  if (count === 0) {
    check(optional, `${pathOf(page.url())}: ${formSelector} has no field "${name}"`);
    return false;
  }
  const first = field.first();
  const tag = await first.evaluate((el) => el.tagName.toLowerCase());
  const type = ((await first.getAttribute('type')) || '').toLowerCase();
  if (tag === 'select') {
    await first.selectOption(String(value));
  } else if (type === 'radio' || type === 'checkbox') {
    await page.locator(`${formSelector} [name="${name}"][value="${value}"]`).check();
  } else {
    await first.fill(String(value));
  }
  return true;
}

/** Text of an element that may be an input (its value) or not (its text). */
async function textOf(locator) {
  const tag = await locator.evaluate((el) => el.tagName.toLowerCase());
  if (tag === 'input' || tag === 'textarea') return (await locator.inputValue()).trim();
  return (await locator.innerText()).trim();
}

/** The secret shown once in #new-key. */
async function newKey(page) {
  const locator = page.locator('#new-key');
  check(
    (await locator.count()) === 1,
    `${pathOf(page.url())}: no #new-key after creating a key ${await messages(page)}`,
  );
  const key = await textOf(locator);
  check(/^\S{16,}$/.test(key), `${pathOf(page.url())}: #new-key is not a key: ${JSON.stringify(key)}`);
  return key;
}

/** A numeric value shown in `selector` (e.g. #balance-usd). */
async function shown(page, selector) {
  const locator = page.locator(selector);
  check((await locator.count()) === 1, `${pathOf(page.url())}: no single ${selector}`);
  const text = await textOf(locator);
  const value = decimal(text);
  check(!Number.isNaN(value), `${pathOf(page.url())}: ${selector} is not a number: ${JSON.stringify(text)}`);
  return value;
}

/**
 * A table as objects keyed by its column headers (lower case), one per body
 * row; the row's `data-key-id` too when it has one.
 */
async function tableRows(page, selector) {
  const table = page.locator(selector);
  check((await table.count()) === 1, `${pathOf(page.url())}: no single ${selector}`);
  return table.evaluate((t) => {
    const headers = [...t.querySelectorAll('thead th, tr:first-child th')].map((th) =>
      th.innerText.trim().toLowerCase(),
    );
    const body = t.tBodies.length ? [...t.tBodies].flatMap((b) => [...b.rows]) : [...t.rows].slice(1);
    return body
      .filter((row) => row.querySelectorAll('td').length > 0)
      .map((row) => {
        const cells = [...row.cells].map((c) => c.innerText.trim());
        const out = { _cells: cells, _text: row.innerText };
        headers.forEach((h, i) => {
          if (h && i < cells.length) out[h] = cells[i];
        });
        if (row.dataset.keyId) out._keyId = row.dataset.keyId;
        return out;
      });
  });
}

/** The requests counted in a usage table (the column whose header says "request"). */
async function usageRequests(page, selector) {
  const rows = await tableRows(page, selector);
  let total = 0;
  for (const row of rows) {
    const column = Object.keys(row).find((k) => !k.startsWith('_') && /request/.test(k));
    if (column) total += decimal(row[column]) || 0;
  }
  return { rows, total };
}

/** The JSON of a chart's data block (`<script type="application/json" id=…>`). */
async function chartData(page, id) {
  const block = page.locator(`script#${id}`);
  check((await block.count()) === 1, `${pathOf(page.url())}: no script#${id}`);
  const type = await block.getAttribute('type');
  check(type === 'application/json', `${pathOf(page.url())}: script#${id} has type ${type}, not application/json`);
  const text = await block.evaluate((el) => el.textContent);
  try {
    return JSON.parse(text);
  } catch (error) {
    throw new Failure(`${pathOf(page.url())}: #${id} is not JSON: ${error.message}: ${text.slice(0, 200)}`);
  }
}

/** Whether any number in a JSON value (a chart's data) is positive. */
function hasPositive(value) {
  if (typeof value === 'number') return value > 0;
  if (typeof value === 'string') return false;
  if (Array.isArray(value)) return value.some(hasPositive);
  if (value && typeof value === 'object') return Object.values(value).some(hasPositive);
  return false;
}

/** The chart drew (uPlot makes a canvas in its div) under the page's CSP. */
async function chartDrawn(page, id, name) {
  const chart = page.locator(`div.chart#${id}`);
  if ((await chart.count()) !== 1) {
    problem(name, `no div.chart#${id}`);
    return;
  }
  try {
    await page.locator(`div.chart#${id} canvas`).first().waitFor({ timeout: 5000 });
  } catch {
    problem(name, `#${id} was not drawn (no uPlot canvas after 5 s)`);
  }
}

const phoneChecked = new Set();

/**
 * The checks every page gets: the contract's landmarks, axe-core, a
 * full-page screenshot, and once per route the phone viewport.
 */
async function checkPage(page, name, { signedIn = true } = {}) {
  const route = new URL(page.url()).pathname;
  console.log(`  page ${name}: ${pathOf(page.url())}`);
  await page.waitForLoadState('load');

  // The contract's skeleton.
  const skeleton = await page.evaluate(() => ({
    lang: document.documentElement.getAttribute('lang'),
    main: document.querySelectorAll('main#main').length,
    nav: document.querySelectorAll('nav[aria-label="Console"]').length,
    h1: document.querySelectorAll('h1').length,
    logout: document.querySelectorAll('form#logout').length,
    inlineScripts: [...document.querySelectorAll('script:not([src])')]
      .filter((s) => s.type !== 'application/json' && s.textContent.trim() !== '')
      .map((s) => s.outerHTML.slice(0, 80)),
    // (uPlot's legend is a table of its own, inside the chart's div.)
    captionless: [...document.querySelectorAll('table')]
      .filter((t) => !t.closest('.chart') && !t.querySelector('caption'))
      .map((t) => (t.id ? `table#${t.id}` : 'table')),
    unscopedHeaders: [...document.querySelectorAll('thead th:not([scope])')].length,
  }));
  if (skeleton.lang !== 'en') problem(name, `<html lang> is ${JSON.stringify(skeleton.lang)}, not "en"`);
  if (skeleton.main !== 1) problem(name, `${skeleton.main} <main id="main"> (want 1)`);
  if (skeleton.nav < 1) {
    if (signedIn) problem(name, 'no <nav aria-label="Console">');
    else note('no <nav aria-label="Console"> (signed out)');
  }
  if (skeleton.h1 !== 1) problem(name, `${skeleton.h1} <h1> (want 1)`);
  if (signedIn && skeleton.logout !== 1) problem(name, 'no form#logout on a signed-in page');
  if (skeleton.inlineScripts.length) problem(name, `inline scripts: ${skeleton.inlineScripts.join(', ')}`);
  if (skeleton.captionless.length) problem(name, `tables without <caption>: ${skeleton.captionless.join(', ')}`);
  if (skeleton.unscopedHeaders) problem(name, `${skeleton.unscopedHeaders} <th> in <thead> without scope`);

  // axe-core. The pages' CSP (script-src 'self') refuses an inline <script>
  // tag, so axe's source is evaluated through the DevTools protocol instead
  // (page.evaluate is not subject to the page's CSP).
  await page.evaluate(AXE_SOURCE);
  const results = await page.evaluate(async () => {
    // eslint-disable-next-line no-undef
    const r = await axe.run(document, { resultTypes: ['violations'] });
    return {
      passes: r.passes.length,
      violations: r.violations.map((v) => ({
      id: v.id,
      impact: v.impact,
      help: v.help,
      helpUrl: v.helpUrl,
      targets: v.nodes.map((n) => n.target.join(' ')),
        summaries: v.nodes.map((n) => n.failureSummary),
      })),
    };
  });
  axeReport.push({ page: name, url: pathOf(page.url()), rulesPassed: results.passes, violations: results.violations });
  if (results.passes === 0) problem(name, 'axe-core checked nothing (no rule passed)');
  for (const v of results.violations) {
    const line = `axe ${v.impact} ${v.id} (${v.help}) on ${v.targets.slice(0, 5).join(', ')}${v.targets.length > 5 ? ', …' : ''}`;
    if (v.impact === 'serious' || v.impact === 'critical') problem(name, line);
    else note(line);
  }

  const file = path.join(OUT_DIR, `${name}.png`);
  await page.screenshot({ path: file, fullPage: true });
  screenshots.push(file);

  if (!phoneChecked.has(route)) {
    phoneChecked.add(route);
    await page.setViewportSize(PHONE);
    await sleep(300); // charts redraw on resize
    const widths = await page.evaluate(() => ({
      scroll: document.documentElement.scrollWidth,
      inner: window.innerWidth,
    }));
    if (widths.scroll > widths.inner) {
      const overflow = widths.scroll - widths.inner;
      const message = `at ${PHONE.width}x${PHONE.height} the page is ${widths.scroll}px wide (${overflow}px of horizontal overflow)`;
      if (overflow > OVERFLOW_FAIL_PX) problem(name, message);
      else note(message);
      await page.screenshot({ path: path.join(OUT_DIR, `${name}.phone.png`), fullPage: true });
    }
    await page.setViewportSize(DESKTOP);
  }
}

/** A chat completion with `key`, from node (not the browser). */
async function chat(key) {
  const response = await fetch(`${BASE}/api/v1/chat/completions`, {
    method: 'POST',
    headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json' },
    body: JSON.stringify({
      model: CHAT_MODEL,
      messages: [{ role: 'user', content: 'Hello from the console browser test' }],
      // The mock upstream reports this many prompt tokens: a visible cost.
      mock: { prompt_tokens: 20000 },
    }),
  });
  const text = await response.text();
  let body;
  try {
    body = JSON.parse(text);
  } catch {
    body = text;
  }
  return { status: response.status, body };
}

async function step(name, fn) {
  const started = Date.now();
  console.log(`▶ ${name}`);
  await fn();
  console.log(`✓ ${name} (${Date.now() - started} ms)`);
}

/** The row of `table#keys` whose "last 6" (or any cell) shows the key's end. */
async function keyRow(page, secret, description) {
  const rows = await tableRows(page, 'table#keys');
  const tail = secret.slice(-6);
  const row =
    rows.find((r) => r._cells.some((c) => c.includes(tail))) ||
    rows.find((r) => r._cells.some((c) => c === description));
  check(
    row,
    `${pathOf(page.url())}: table#keys has no row for the new key (…${tail}, "${description}"): ${JSON.stringify(rows.map((r) => r._cells))}`,
  );
  check(row._keyId, `${pathOf(page.url())}: the key's row has no data-key-id`);
  return row;
}

async function revoke(page, keyId) {
  const form = `tr[data-key-id="${keyId}"] form.revoke-key`;
  const response = await submit(page, form);
  check(
    response && response.status() === 200,
    `revoking key ${keyId}: ${response?.status()} at ${pathOf(page.url())} ${await messages(page)}`,
  );
  const status = await page.locator('[role=status]').allInnerTexts();
  check(status.join('').trim() !== '', `${pathOf(page.url())}: no role="status" message after revoking a key`);
}

// ---------------------------------------------------------------------------

const state = {};

async function operatorFlow(browser) {
  const context = await newContext(browser, 'operator');
  const page = await newPage(context);

  await step('operator: sign in', async () => {
    await open(page, '/console/login');
    await checkPage(page, 'login', { signedIn: false });
    for (const selector of ['form#operator-login', 'form#key-login', 'button#wallet-login']) {
      check((await page.locator(selector).count()) === 1, `/console/login: no ${selector}`);
    }
    await setField(page, 'form#operator-login', 'token', OPERATOR_TOKEN);
    const response = await submit(page, 'form#operator-login');
    check(
      pathOf(page.url()).startsWith('/console/accounts'),
      `operator sign-in ended at ${pathOf(page.url())} (${response?.status()}), not /console/accounts ${await messages(page)}`,
    );
    await checkPage(page, 'operator-accounts');
  });

  await step('operator: create an account', async () => {
    // Readable in the README's screenshots (each test run has a fresh database).
    state.accountName = process.env.ACCOUNT_NAME || 'Acme Research';
    await setField(page, 'form#create-account', 'name', state.accountName);
    const tier = page.locator('form#create-account [name="tier"]');
    if ((await tier.count()) && (await tier.locator('option[value="standard"]').count())) {
      await tier.selectOption('standard');
    }
    const response = await submit(page, 'form#create-account');
    check(response?.status() === 200, `creating an account: ${response?.status()} ${await messages(page)}`);
    state.adminKey = await newKey(page);
    note(`account "${state.accountName}", ADMIN key …${state.adminKey.slice(-6)}`);
    const link = page.locator('a#account-link');
    check((await link.count()) === 1, `${pathOf(page.url())}: no a#account-link`);
    const href = await link.getAttribute('href');
    const match = /\/console\/accounts\/([^/?#]+)$/.exec(new URL(href, BASE).pathname);
    check(match, `a#account-link points to ${href}, not /console/accounts/<id>`);
    state.accountId = decodeURIComponent(match[1]);
    await checkPage(page, 'operator-account-created');

    // The accounts list finds it by name and links it.
    await open(page, `/console/accounts?search=${encodeURIComponent(state.accountName)}`);
    const linked = page.locator(`table#accounts a[href="/console/accounts/${state.accountId}"]`);
    check((await linked.count()) >= 1, `table#accounts (search ${state.accountName}) does not link the new account`);

    await open(page, `/console/accounts/${state.accountId}`);
    const balance = await shown(page, '#balance-usd');
    check(balance === 0, `a new account's #balance-usd is ${balance}, not 0`);
  });

  await step('operator: credit $1 (the same form twice credits once)', async () => {
    await setField(page, 'form#credit', 'usd', '1');
    const diem = page.locator('form#credit [name="diem"]');
    if ((await diem.count()) && (await diem.inputValue()) === '') await diem.fill('0');
    // The form as it will be posted, to post it again.
    const fields = await page.locator('form#credit').evaluate((form) => ({
      action: form.action,
      values: Object.fromEntries(new FormData(form)),
    }));
    check(fields.values.reference, 'form#credit has no reference field');
    check(fields.values.csrf, 'form#credit has no csrf field');
    const response = await submit(page, 'form#credit');
    check(response?.status() === 200, `crediting: ${response?.status()} ${await messages(page)}`);
    check(
      new URL(page.url()).pathname === `/console/accounts/${state.accountId}`,
      `after crediting the browser is at ${pathOf(page.url())}, not the account page`,
    );
    check((await messages(page)) !== '', 'no role="status" message after crediting');
    check((await shown(page, '#balance-usd')) === 1, `#balance-usd is ${await shown(page, '#balance-usd')} after a $1 credit`);

    const again = await page.request.post(fields.action, {
      form: fields.values,
      headers: { origin: BASE },
      maxRedirects: 0,
    });
    check(
      again.status() === 303 || again.status() === 200,
      `posting form#credit again answered ${again.status()}: ${(await again.text()).slice(0, 300)}`,
    );
    await open(page, `/console/accounts/${state.accountId}`);
    const balance = await shown(page, '#balance-usd');
    check(balance === 1, `#balance-usd is ${balance} after posting the same credit form twice (want 1: credited once)`);
  });

  await step('operator: create an INFERENCE key', async () => {
    state.inferenceDescription = 'Production inference';
    await setField(page, 'form#create-key', 'description', state.inferenceDescription);
    await setField(page, 'form#create-key', 'type', 'INFERENCE');
    const response = await submit(page, 'form#create-key');
    check(response?.status() === 200, `creating a key: ${response?.status()} ${await messages(page)}`);
    state.inferenceKey = await newKey(page);
    const row = await keyRow(page, state.inferenceKey, state.inferenceDescription);
    state.inferenceKeyId = row._keyId;
    check(/inference/i.test(row._text), `the new key's row does not say INFERENCE: ${row._cells.join(' | ')}`);
    note(`INFERENCE key ${state.inferenceKeyId} …${state.inferenceKey.slice(-6)}`);
  });

  await step('operator: a chat with the key shows in the usage and the balance', async () => {
    const answer = await chat(state.inferenceKey);
    check(answer.status === 200, `chat with the new key: ${answer.status} ${JSON.stringify(answer.body).slice(0, 300)}`);
    note(`chat usage ${JSON.stringify(answer.body.usage)}`);
    const result = await eventually('the chat in the account page (balance below 1, a request in table#usage-table)', async () => {
      await open(page, `/console/accounts/${state.accountId}`);
      const balance = await shown(page, '#balance-usd');
      const usage = await usageRequests(page, 'table#usage-table');
      return balance < 1 && usage.total >= 1 ? { balance, usage } : null;
    });
    const used = result.usage.rows.filter((r) => r._cells.slice(1).some((c) => decimal(c) > 0));
    note(`balance ${result.balance}; usage table, days with usage: ${JSON.stringify(used.map((r) => r._cells))}`);
    const data = await chartData(page, 'usage-data');
    check(hasPositive(data), `#usage-data has no positive number after a chat: ${JSON.stringify(data).slice(0, 300)}`);
    await chartDrawn(page, 'usage-chart', 'operator-account');
    const keyAfter = await keyRow(page, state.inferenceKey, state.inferenceDescription);
    const lastUsed = Object.entries(keyAfter).find(([k]) => /last used/.test(k));
    note(`the key's "last used" after its chat: ${lastUsed ? JSON.stringify(lastUsed[1]) : '(no such column)'}`);
    // The values are #tier-value and #stake-value; the forms #tier and #stake.
    for (const selector of ['#balance-diem', '#usd-held', '#stake-value', '#tier-value', '#status', 'table#limit-hits', 'form#tier', 'form#stake']) {
      if ((await page.locator(selector).count()) !== 1) problem('operator-account', `no single ${selector}`);
    }
    note(`#tier-value ${await textOf(page.locator('#tier-value'))}, #stake-value ${await textOf(page.locator('#stake-value'))}`);
    if ((await page.locator('form#suspend, form#resume').count()) !== 1) {
      problem('operator-account', 'neither form#suspend nor form#resume');
    }
    await checkPage(page, 'operator-account');
  });

  await step('operator: revoke the key, the next chat is refused', async () => {
    await revoke(page, state.inferenceKeyId);
    const answer = await eventually('a 401 for the revoked key', async () => {
      const a = await chat(state.inferenceKey);
      return a.status === 401 ? a : null;
    }, 5000);
    note(`chat with the revoked key: ${answer.status} ${JSON.stringify(answer.body).slice(0, 200)}`);
    await checkPage(page, 'operator-account-revoked');
  });

  await step('operator: every page', async () => {
    await open(page, `/console/accounts`);
    const rows = await tableRows(page, 'table#accounts');
    check(rows.length >= 1, 'table#accounts is empty');
    await checkPage(page, 'operator-accounts-list');

    await open(page, '/console/models');
    const backends = await tableRows(page, 'table#backends');
    check(
      backends.some((r) => r._text.includes(CHAT_MODEL)),
      `table#backends has no row for ${CHAT_MODEL}: ${JSON.stringify(backends.map((r) => r._cells))}`,
    );
    await checkPage(page, 'operator-models');

    await open(page, '/console/spend?days=30');
    // A column (or a row) per model.
    const spend = await page.locator('table#spend-table').innerText();
    if (!spend.includes(CHAT_MODEL)) {
      problem('operator-spend', `table#spend-table does not show ${CHAT_MODEL} after a chat:\n${spend}`);
    }
    await chartData(page, 'spend-data');
    await chartDrawn(page, 'spend-chart', 'operator-spend');
    await checkPage(page, 'operator-spend');

    await open(page, '/console/rate-limits');
    await tableRows(page, 'table#rate-limit-log');
    await checkPage(page, 'operator-rate-limits');

    await open(page, '/console/top-ups');
    await tableRows(page, 'table#top-ups');
    await checkPage(page, 'operator-top-ups');
  });

  await step('operator: sign out', async () => {
    await submit(page, 'form#logout');
    check(
      new URL(page.url()).pathname === '/console/login',
      `after signing out the browser is at ${pathOf(page.url())}, not /console/login`,
    );
    await page.goto(`${BASE}/console/accounts`);
    check(
      new URL(page.url()).pathname === '/console/login',
      `after signing out /console/accounts ended at ${pathOf(page.url())}, not the login page`,
    );
  });

  await context.close();
}

async function holderFlow(browser) {
  check(state.adminKey, 'the account holder flow needs the operator flow (its ADMIN key)');
  const context = await newContext(browser, 'holder');
  const page = await newPage(context);

  await step('account holder: sign in with the ADMIN key', async () => {
    await open(page, '/console/login');
    await setField(page, 'form#key-login', 'api_key', state.adminKey);
    const response = await submit(page, 'form#key-login');
    check(
      new URL(page.url()).pathname === '/console/account',
      `key sign-in ended at ${pathOf(page.url())} (${response?.status()}), not /console/account ${await messages(page)}`,
    );
    const balance = await shown(page, '#balance-usd');
    check(balance < 1 && balance > 0, `the account holder's #balance-usd is ${balance}, want between 0 and 1`);
    await shown(page, '#balance-diem');
    check((await page.locator('#can-consume').count()) === 1, '/console/account: no #can-consume');
    await checkPage(page, 'account-overview');
  });

  await step('account holder: usage (chart, table, CSV)', async () => {
    await open(page, '/console/account/usage?days=30');
    const usage = await usageRequests(page, 'table#usage-table');
    check(usage.total >= 1, `table#usage-table shows no request: ${JSON.stringify(usage.rows.map((r) => r._cells))}`);
    const data = await chartData(page, 'usage-data');
    check(hasPositive(data), `#usage-data has no positive number: ${JSON.stringify(data).slice(0, 300)}`);
    await chartDrawn(page, 'usage-chart', 'account-usage');
    const link = page.locator('a#usage-csv');
    check((await link.count()) === 1, '/console/account/usage: no a#usage-csv');
    const href = new URL(await link.getAttribute('href'), page.url()).toString();
    check(new URL(href).pathname === '/console/account/usage.csv', `a#usage-csv points to ${href}`);
    const csv = await page.request.get(href);
    check(csv.status() === 200, `GET ${pathOf(href)}: ${csv.status()}`);
    const headers = csv.headers();
    check(/^text\/csv/.test(headers['content-type'] || ''), `usage.csv is ${headers['content-type']}, not text/csv`);
    check(/attachment/.test(headers['content-disposition'] || ''), `usage.csv's content-disposition is ${headers['content-disposition']}, not an attachment`);
    const lines = (await csv.text()).split(/\r?\n/).filter((l) => l.trim() !== '');
    fs.writeFileSync(path.join(OUT_DIR, 'account-usage.csv'), lines.join('\n') + '\n');
    check(lines.length >= 2, `usage.csv has no row under its header: ${JSON.stringify(lines)}`);
    check(
      lines.slice(1).some((l) => l.includes(CHAT_MODEL)),
      `usage.csv has no row for ${CHAT_MODEL}: ${JSON.stringify(lines.slice(0, 5))}`,
    );
    note(`usage.csv: ${lines.length - 1} row(s); header ${lines[0]}`);
    await checkPage(page, 'account-usage');
  });

  await step('account holder: create a key with a USD cap, see it once, revoke it', async () => {
    await open(page, '/console/account/keys');
    await tableRows(page, 'table#keys');
    await checkPage(page, 'account-keys');
    const description = 'Nightly batch (capped)';
    await setField(page, 'form#create-key', 'description', description);
    await setField(page, 'form#create-key', 'type', 'INFERENCE');
    await setField(page, 'form#create-key', 'usd_cap', '0.5');
    await setField(page, 'form#create-key', 'period', 'LIFETIME', { optional: true });
    const response = await submit(page, 'form#create-key');
    check(response?.status() === 200, `creating a key: ${response?.status()} ${await messages(page)}`);
    const secret = await newKey(page);
    const row = await keyRow(page, secret, description);
    if (!row._cells.some((c) => /0\.5/.test(c))) {
      problem('account-keys', `the capped key's row does not show its $0.5 cap: ${row._cells.join(' | ')}`);
    }
    await checkPage(page, 'account-keys-created');

    const works = await chat(secret);
    check(works.status === 200, `chat with the capped key: ${works.status} ${JSON.stringify(works.body).slice(0, 300)}`);

    await open(page, '/console/account/keys');
    check((await page.locator('#new-key').count()) === 0, '#new-key is shown again after a reload');
    check(!(await page.content()).includes(secret), 'the key secret is in the keys page after a reload');

    await revoke(page, row._keyId);
    await eventually('a 401 for the revoked capped key', async () => (await chat(secret)).status === 401, 5000);
  });

  await step('account holder: limits', async () => {
    await open(page, '/console/account/limits');
    await tableRows(page, 'table#rate-limits');
    await tableRows(page, 'table#limit-hits');
    await checkPage(page, 'account-limits');
  });

  await step('account holder: no operator page', async () => {
    const response = await page.goto(`${BASE}/console/accounts`);
    const status = response?.status();
    const ended = new URL(page.url()).pathname;
    check(
      status === 403 || status === 404 || ended !== '/console/accounts',
      `an ADMIN key session was served the operator page /console/accounts (${status})`,
    );
    note(`/console/accounts for an account holder: ${status} at ${ended}`);
  });

  await context.close();
}

async function walletFlow(browser) {
  const account = privateKeyToAccount(WALLET_KEY.startsWith('0x') ? WALLET_KEY : `0x${WALLET_KEY}`);
  const context = await newContext(browser, 'wallet');
  const calls = [];
  const signed = [];
  await context.exposeBinding('__rialtoWallet', async (_source, method, params) => {
    calls.push(method);
    if (method === 'personal_sign') {
      const [message, address] = params || [];
      if (String(address).toLowerCase() !== account.address.toLowerCase()) {
        throw new Error(`personal_sign for ${address}, not the wallet's ${account.address}`);
      }
      const isHex = typeof message === 'string' && /^0x([0-9a-fA-F]{2})*$/.test(message);
      const text = isHex ? Buffer.from(message.slice(2), 'hex').toString('utf8') : String(message);
      signed.push(text);
      return account.signMessage({ message: isHex ? { raw: message } : text });
    }
    throw new Error(`unexpected wallet method ${method}`);
  });
  await context.addInitScript((address) => {
    const provider = {
      isRialtoTestWallet: true,
      async request({ method, params }) {
        switch (method) {
          case 'eth_requestAccounts':
          case 'eth_accounts':
            return [address];
          case 'eth_chainId':
            return '0x2105'; // Base, 8453
          case 'net_version':
            return '8453';
          case 'personal_sign':
            return window.__rialtoWallet(method, params);
          default: {
            const error = new Error(`The test wallet does not support ${method}`);
            error.code = 4200;
            throw error;
          }
        }
      },
      on() {},
      removeListener() {},
    };
    Object.defineProperty(window, 'ethereum', { value: provider, configurable: true });
  }, account.address);
  const page = await newPage(context);

  await step('wallet: Sign-In-With-X through window.ethereum', async () => {
    await open(page, '/console/login');
    await page.locator('button#wallet-login').click();
    try {
      await page.waitForURL((url) => url.pathname === '/console/account', { timeout: 20000 });
    } catch {
      const error = await page.locator('#wallet-error').innerText().catch(() => '(no #wallet-error)');
      throw new Failure(
        `wallet sign-in did not reach /console/account (at ${pathOf(page.url())}); #wallet-error: ${JSON.stringify(error)}; ` +
          `wallet calls: ${calls.join(', ') || 'none'}; signed: ${JSON.stringify(signed)}`,
      );
    }
    await page.waitForLoadState('load');
    check(signed.length === 1, `the wallet signed ${signed.length} messages, want 1`);
    const message = signed[0];
    note(`signed message:\n${message.replace(/^/gm, '      ')}`);
    check(message.includes(account.address), `the sign-in message does not name the address ${account.address}`);
    check(/Chain ID: 8453/.test(message), 'the sign-in message is not for chain 8453 (Base)');
    const balance = await shown(page, '#balance-usd');
    note(`wallet ${account.address}: #balance-usd ${balance}`);
    await checkPage(page, 'wallet-account');
  });

  await step('wallet: account pages', async () => {
    await open(page, '/console/account/keys');
    await tableRows(page, 'table#keys');
    await checkPage(page, 'wallet-keys');
    await open(page, '/console/account/usage?days=30');
    await chartData(page, 'usage-data');
    await checkPage(page, 'wallet-usage');
  });

  await context.close();
}

// ---------------------------------------------------------------------------

/** `default-src 'self'; …` as a map of directive to its value. */
function directives(policy) {
  return new Map(
    String(policy || '')
      .split(';')
      .map((d) => d.trim().split(/\s+/))
      .filter((d) => d[0])
      .map(([name, ...values]) => [name.toLowerCase(), values.join(' ')]),
  );
}

/** The console's Content-Security-Policy has (at least) the contract's directives. */
async function headers() {
  const response = await fetch(`${BASE}/console/login`);
  const csp = response.headers.get('content-security-policy');
  const got = directives(csp);
  for (const [name, value] of directives(CSP)) {
    if (got.get(name) !== value) {
      problem('/console/login', `Content-Security-Policy ${name} is ${JSON.stringify(got.get(name))}, want ${JSON.stringify(value)} (policy ${JSON.stringify(csp)})`);
    }
  }
  const extra = [...got.keys()].filter((name) => !directives(CSP).has(name));
  if (extra.length) note(`Content-Security-Policy adds ${extra.join(', ')} to the contract's`);
}

async function main() {
  console.log(`console browser tests: ${BASE}, ${CHROMIUM}, screenshots in ${OUT_DIR}`);
  const browser = await chromium.launch({
    executablePath: CHROMIUM,
    headless: process.env.HEADED !== '1',
    args: ['--disable-dev-shm-usage', '--lang=en-US'],
  });
  console.log(`Chromium ${browser.version()}, axe-core ${JSON.parse(fs.readFileSync(path.join(here, 'node_modules/axe-core/package.json'), 'utf8')).version}`);
  let failed = null;
  try {
    await headers();
    if (FLOWS.includes('operator')) await operatorFlow(browser);
    if (FLOWS.includes('holder')) await holderFlow(browser);
    if (FLOWS.includes('wallet')) await walletFlow(browser);
  } catch (error) {
    failed = error;
    for (const context of browser.contexts()) {
      for (const page of context.pages()) {
        const file = path.join(OUT_DIR, `failure-${context.label || 'context'}.png`);
        await page.screenshot({ path: file, fullPage: true }).catch(() => {});
        console.log(`  failure screenshot: ${file} (${pathOf(page.url())})`);
        const alerts = await messages(page);
        if (alerts) console.log(`  messages on the page: ${alerts}`);
      }
    }
  } finally {
    await browser.close().catch(() => {});
  }
  fs.writeFileSync(path.join(OUT_DIR, 'axe-report.json'), JSON.stringify(axeReport, null, 2));
  console.log(`\n${screenshots.length} screenshots in ${OUT_DIR}; axe results in ${path.join(OUT_DIR, 'axe-report.json')}`);
  if (failed) {
    console.log(`\nFAILED: ${failed instanceof Failure ? failed.message : failed.stack || failed}`);
  }
  if (problems.length) {
    console.log(`\n${problems.length} problem(s):`);
    for (const p of problems) console.log(`  - ${p}`);
  }
  if (failed || problems.length) process.exit(1);
  console.log('\nconsole browser tests: all passed');
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
