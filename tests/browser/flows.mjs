// The chat page's user flows in a real headless browser: Debian's chromium driven by playwright-core.
//   node flows.mjs FLOW URL [KEY]
// runs one flow against a running `goinfer serve` at URL, asserting what the page shows; it prints one JSON line
// of what the flow saw (tests/test_browser.py checks it against the API) and saves a screenshot of the end state
// in $SHOTS when that is set. Exit 1 with the failed assertion on stderr.

import assert from "node:assert/strict";
import { mkdirSync } from "node:fs";
import { chromium } from "playwright-core";

const [flowName, url, key] = process.argv.slice(2);
const CHROMIUM = process.env.CHROMIUM || "/usr/bin/chromium";
// A closed network: no background fetches, no sandbox (CI runs as root), no GPU.
const ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
              "--disable-sync", "--no-first-run", "--disable-quic"];
const PYTHON_PROMPT = "Write a Python function that adds two numbers, with a short explanation.";

// ------------------------------------------------------------------ what a user does

async function open(browser, options = {}) {
  const context = await browser.newContext({ viewport: { width: 1200, height: 800 }, ...options });
  const page = await context.newPage();
  page.errors = [];
  page.on("pageerror", (e) => page.errors.push(e.message));
  page.on("console", (m) => { if (m.type() === "error") page.errors.push(m.text()); });
  await page.goto(url);
  return page;
}

async function models(page) {
  await page.waitForFunction(() => document.querySelectorAll("#model option").length > 0);
  return page.$$eval("#model option", (options) => options.map((o) => o.value));
}

async function setting(page, apply) {
  if (await page.isHidden("#settings")) await page.click("#settings-toggle");
  await apply();
}

async function greedy(page, maxTokens) {
  await setting(page, async () => {
    await page.focus("#temp");
    await page.keyboard.press("Home");  // the slider's minimum: temperature 0
    if (maxTokens) await page.fill("#max", String(maxTokens));
    await page.press("#max", "Tab");
  });
  assert.equal(await page.textContent("#temp-value"), "0.00");
  await page.click("#settings-toggle");
  assert.ok(await page.isHidden("#settings"), "the settings panel folds away");
}

async function send(page, text) {
  await page.fill("#input", text);
  await page.press("#input", "Enter");
}

async function replied(page) {
  await page.waitForSelector("#send:not([hidden])", { timeout: 120000 });
  return page.locator(".msg.assistant").last();
}

const stored = (page) => page.evaluate(() => JSON.parse(localStorage.getItem("goinfer-conversations") || "[]"));

// ------------------------------------------------------------------ the flows

const flows = {
  // Load, send, watch the answer stream in and come out as Markdown with a copy button and a tokens/s line.
  async chat(browser) {
    const page = await open(browser, { permissions: ["clipboard-read", "clipboard-write"] });
    assert.equal(await page.title(), "goinfer");
    const names = await models(page);
    await greedy(page, 256);
    await send(page, PYTHON_PROMPT);
    assert.equal(await page.locator(".msg.user .body").last().textContent(), PYTHON_PROMPT);
    assert.ok(await page.isHidden("#send") && await page.isVisible("#stop"), "Stop replaces Send while it answers");
    await page.waitForFunction(() => document.querySelector(".msg.assistant .body.caret")?.textContent.length > 0,
                               null, { polling: "raf", timeout: 120000 });  // text shows before the reply ends
    const reply = await replied(page);
    const body = reply.locator(".body");
    assert.ok(await body.locator(".code pre code.language-python").count() > 0, "a fenced block became code");
    assert.ok(!(await body.textContent()).includes("```"), "no raw fence is shown");
    const meta = await reply.locator(".meta").textContent();
    const name = names[0].replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
    assert.match(meta, new RegExp(`^${name} · \\d+ tokens · [\\d.]+ tokens/s · first token after `));
    await body.locator(".copy").first().click();
    await page.waitForFunction(() => document.querySelector(".copy")?.textContent === "Copied");
    const copied = await page.evaluate(() => navigator.clipboard.readText());
    assert.equal(copied, await body.locator("pre code").first().textContent());
    assert.equal(await page.locator("#conversations .conv").count(), 1);
    assert.deepEqual(page.errors, []);
    return { model: names[0], meta, conversation: (await stored(page))[0], page };
  },

  // Pick the second model: the request goes to it and the reply says which model wrote it.
  async pick(browser) {
    const page = await open(browser);
    const names = await models(page);
    assert.ok(names.length >= 2, `two models served, got ${names}`);
    await page.selectOption("#model", names[1]);
    await greedy(page, 24);
    const request = page.waitForRequest((r) => r.url().endsWith("/v1/chat/completions"));
    await send(page, "Say hello.");
    assert.equal(JSON.parse((await request).postData()).model, names[1]);
    const reply = await replied(page);
    assert.ok((await reply.locator(".meta").textContent()).startsWith(`${names[1]} · `));
    await page.reload();
    assert.equal(await page.inputValue("#model"), names[1], "the choice outlives a reload");
    return { model: names[1], page };
  },

  // Stop a long reply: the text so far stays, marked as stopped, and the next message is answered.
  async stop(browser) {
    const page = await open(browser);
    await models(page);
    await greedy(page, 3000);
    await send(page, "List all the numbers from 1 to 1000 separated by commas.");  // 3000 tokens, greedy
    await page.waitForFunction(() => document.querySelector(".msg.assistant .body.caret")?.textContent.length > 20,
                               null, { polling: "raf", timeout: 120000 });
    await page.click("#stop");
    const reply = await replied(page);
    assert.match(await reply.locator(".meta").textContent(), / · stopped$/);
    const kept = (await stored(page))[0].messages;
    assert.equal(kept.length, 2);
    assert.ok(kept[1].content.startsWith("1, 2, 3"), "the text before the stop is kept");
    assert.equal((await reply.locator(".body").textContent()).trim(), kept[1].content.trim());
    await greedy(page, 16);
    await send(page, "Thanks.");
    await replied(page);
    assert.equal(await page.locator(".msg.assistant").count(), 2);
    assert.deepEqual(page.errors, []);
    return { stopped: kept[1].content, page };
  },

  // Reload and find the conversation; switch to a new chat and back; delete it.
  async reload(browser) {
    const page = await open(browser);
    await models(page);
    await greedy(page, 32);
    await send(page, "What is the capital of France?");
    const before = await (await replied(page)).locator(".body").innerHTML();
    await page.reload();
    await models(page);
    assert.equal(await page.locator(".msg.user .body").textContent(), "What is the capital of France?");
    assert.equal(await page.locator(".msg.assistant .body").innerHTML(), before);
    const item = page.locator("#conversations .conv");
    assert.equal(await item.locator(".open").textContent(), "What is the capital of France?");
    await page.click("#new-chat");
    assert.equal(await page.locator(".msg").count(), 0);
    assert.ok(await page.isVisible("#empty"));
    await item.locator(".open").click();
    assert.equal(await page.locator(".msg").count(), 2);
    await item.hover();
    await item.locator(".delete").click();
    assert.equal(await page.locator("#conversations .conv").count(), 0);
    assert.equal(await page.locator(".msg").count(), 0);
    assert.deepEqual(await stored(page), []);
    return { page };
  },

  // A keyed server: the page says a key is needed, refuses a wrong one in words, works with the right one.
  async keyed(browser) {
    const page = await open(browser);
    await page.waitForFunction(() => document.querySelector("#status").textContent.includes("API key"));
    assert.equal(await page.textContent("#status"), "This server needs an API key: enter it in Settings.");
    assert.ok(await page.isVisible("#key"), "the settings open on the key");
    await page.fill("#key", "wrong-key");
    await page.press("#key", "Enter");
    await page.waitForFunction(() => document.querySelector("#status").textContent.includes("refused"));
    await page.fill("#key", key);
    await page.press("#key", "Enter");
    const names = await models(page);
    await greedy(page, 16);
    await send(page, "Say hello.");
    const reply = await replied(page);
    assert.ok((await reply.locator(".body").textContent()).length > 0);
    assert.ok(!(await reply.getAttribute("class")).includes("error"));
    return { model: names[0], page };
  },

  // 360 px to 1600 px, light and dark: one header row, nothing wider than the window, the drawer on narrow ones.
  async layout(browser) {
    const seen = [];
    let page;
    for (const [width, scheme] of [[360, "light"], [768, "dark"], [1200, "light"], [1600, "dark"]]) {
      page = await open(browser, { viewport: { width, height: 800 }, colorScheme: scheme });
      await models(page);
      await page.evaluate(() => localStorage.setItem("goinfer-conversations", JSON.stringify([{
        id: "c1", title: "A long title that has to be cut somewhere in the list", updated: 1,
        messages: [{ role: "user", content: "x".repeat(300) },
                   { role: "assistant", content: "```\n" + "y".repeat(400) + "\n```\n\n| a | b |\n|-|-|\n| 1 | 2 |" }],
      }])));
      await page.reload();
      await models(page);
      const box = await page.evaluate(() => ({
        header: document.querySelector("header").getBoundingClientRect().height,
        scroll: document.documentElement.scrollWidth, inner: window.innerWidth,
        composer: document.querySelector("#composer").getBoundingClientRect().bottom <= window.innerHeight,
        background: getComputedStyle(document.body).backgroundColor,
      }));
      assert.ok(box.header < 60, `${width}px: the header is one row (${box.header}px)`);
      assert.ok(box.scroll <= box.inner, `${width}px: nothing overflows the window (${box.scroll} > ${box.inner})`);
      assert.ok(box.composer, `${width}px: the message box is on screen`);
      const [r, g, b] = box.background.match(/\d+/g).map(Number);
      assert.equal((r + g + b) / 3 < 128, scheme === "dark", `${scheme} follows the system (${box.background})`);
      const sidebar = await page.isVisible("#sidebar");
      assert.equal(sidebar, width > 860, `${width}px: the conversation list is ${sidebar ? "shown" : "a drawer"}`);
      if (!sidebar) {
        await page.click("#menu");
        await page.locator("#conversations .open").click();  // it opens, and picking one closes it
        await page.waitForFunction(() => !document.body.classList.contains("drawer"));
      }
      seen.push({ width, scheme, header: box.header });
      if (process.env.SHOTS) await page.screenshot({ path: `${process.env.SHOTS}/layout-${width}-${scheme}.png` });
      assert.deepEqual(page.errors, []);
    }
    return { seen, page };
  },

  // A reply carrying HTML runs nothing: the sanitizer strips handlers and scripts, links open a new tab.
  async sanitize(browser) {
    const page = await open(browser);
    await page.evaluate(() => localStorage.setItem("goinfer-conversations", JSON.stringify([{
      id: "c1", title: "x", updated: 1, messages: [{ role: "user", content: "hi" }, { role: "assistant", content:
        "**bold** <img src=x onerror=\"window.pwned=1\"> <script>window.pwned=2</script>" +
        " [a link](https://example.com)" +
        " <a href=\"javascript:window.pwned=3\">js</a> <iframe src=\"/\"></iframe>" }] }])));
    await page.reload();
    await page.waitForSelector(".msg.assistant strong");
    await page.click(".msg.assistant a >> text=js").catch(() => {});
    await page.waitForTimeout(300);
    assert.equal(await page.evaluate(() => window.pwned), undefined, "no script from a reply ran");
    const body = page.locator(".msg.assistant .body");
    assert.equal(await body.locator("script, iframe, [onerror]").count(), 0);
    const link = body.locator("a >> text=a link");
    assert.equal(await link.getAttribute("target"), "_blank");
    assert.equal(await link.getAttribute("rel"), "noopener noreferrer");
    return { html: await body.innerHTML(), page };
  },

  // "Answer now" while the model thinks: the bar explains the button, the click ends the thinking, and the reply
  // answers, its thinking folded away above it. The kit's tiny qwen3 (random weights) thinks only inside a block
  // opened for it, so the flow adds the opening as an assistant prefill to the page's request, as a client may.
  async answerNow(browser) {
    const page = await open(browser);
    await models(page);
    await page.route("**/v1/chat/completions", (route) => {
      const body = JSON.parse(route.request().postData());
      body.messages.push({ role: "assistant", content: "<think>\n" });
      route.continue({ postData: JSON.stringify(body) });
    });
    await greedy(page, 4000);
    await send(page, "Hello");
    await page.waitForSelector("#thinking-bar:not([hidden])", { timeout: 120000 });
    assert.match(await page.textContent("#thinking-bar"), /Answer now\s+ends its thinking and makes it answer/);
    assert.ok(await page.locator(".msg.assistant .thinking[open]").isVisible(), "the thinking shows as it comes");
    const control = page.waitForResponse((r) => r.url().endsWith("/v1/chat/completions/control"));
    await page.click("#answer-now");
    assert.equal((await control).status(), 200);
    const reply = await replied(page);
    assert.ok(await page.isHidden("#thinking-bar"));
    assert.equal(await reply.locator(".thinking summary").textContent(), "Thinking");
    assert.equal(await reply.locator(".thinking").getAttribute("open"), null, "folded once answered");
    const message = (await stored(page))[0].messages[1];
    assert.ok(message.reasoning.length > 0 && message.content.length > 0, "it thought, then answered");
    return { reasoning: message.reasoning.length, content: message.content.length, page };
  },
};

// ------------------------------------------------------------------ run one

const browser = await chromium.launch({ executablePath: CHROMIUM, args: ARGS });
let page;
try {
  const { page: last, ...seen } = await flows[flowName](browser);
  page = last;
  console.log(JSON.stringify(seen));
} catch (e) {
  console.error(e.stack || String(e));
  process.exitCode = 1;
} finally {
  if (process.env.SHOTS && page) {
    mkdirSync(process.env.SHOTS, { recursive: true });
    await page.screenshot({ path: `${process.env.SHOTS}/${flowName}.png` }).catch(() => {});
  }
  await browser.close();
}
