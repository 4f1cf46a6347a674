// goinfer's built-in chat page (GET /): this server's OpenAI chat API, streamed, with the conversations kept in
// the browser. The pieces: stream.js reads the stream, conversations.js keeps the list, markdown.js renders
// replies; this file wires them to the page.

import { applyChunk, newReply, parseSSE, replyStats } from "./stream.js";
import { apiMessages, loadConversations, newConversation, saveConversations, upsert } from "./conversations.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const emptyState = $("empty");  // kept aside: it leaves the log while a conversation is shown
const SETTINGS_KEY = "goinfer-settings";
const KEY_KEY = "goinfer-key";

const settings = { temperature: 0.7, max_tokens: 512, system: "", model: "",
                   ...JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") };
let conversations = loadConversations(localStorage);
let current = newConversation();
let running = null;  // {controller, replyId} while a reply streams

// ------------------------------------------------------------------ settings

const apiKey = () => localStorage.getItem(KEY_KEY) || "";
const headers = () => ({ "Content-Type": "application/json",
                         ...(apiKey() ? { Authorization: `Bearer ${apiKey()}` } : {}) });

function saveSettings() { localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings)); }

function showSettings(open) {
  $("settings").hidden = !open;
  $("settings-toggle").setAttribute("aria-expanded", String(open));
}

function wireSettings() {
  $("temp").value = settings.temperature;
  $("temp-value").textContent = Number(settings.temperature).toFixed(2);
  $("max").value = settings.max_tokens;
  $("system").value = settings.system;
  $("key").value = apiKey();
  $("temp").oninput = () => {
    settings.temperature = Number($("temp").value);
    $("temp-value").textContent = settings.temperature.toFixed(2);
    saveSettings();
  };
  $("max").onchange = () => { settings.max_tokens = Math.max(1, Number($("max").value) || 512); saveSettings(); };
  $("system").onchange = () => { settings.system = $("system").value.trim(); saveSettings(); };
  $("key").onchange = () => { localStorage.setItem(KEY_KEY, $("key").value.trim()); loadModels(); };
  $("settings").onsubmit = (e) => e.preventDefault();  // Enter in a field keeps the page
  $("settings-toggle").onclick = () => showSettings($("settings").hidden);
  $("model").onchange = () => { settings.model = $("model").value; saveSettings(); };
}

// ------------------------------------------------------------------ models

async function loadModels() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json().catch(() => ({}));
    if (r.status === 401) {
      status(apiKey() ? "The API key was refused: check it in Settings." :
                        "This server needs an API key: enter it in Settings.");
      showSettings(true);
      $("key").focus();
      return;
    }
    if (!r.ok) throw new Error(body.error?.message || r.statusText);
    const names = body.data.filter((m) => m.type !== "embedding").map((m) => m.id);
    $("model").replaceChildren(...names.map((name) => new Option(name, name)));
    if (names.includes(settings.model)) $("model").value = settings.model;
    settings.model = $("model").value;
    status(names.length ? "" : "This server serves no chat model.");
  } catch (e) {
    status(`Could not list the models: ${e.message}`);
  }
}

// ------------------------------------------------------------------ conversations

function renderList() {
  const items = conversations.map((c) => {
    const row = document.createElement("div");
    row.className = "conv";
    row.dataset.id = c.id;
    row.setAttribute("aria-current", String(c.id === current.id));
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = open.title = c.title;
    open.onclick = () => { if (!running) { current = c; renderConversation(); renderList(); drawer(false); } };
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "delete";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Delete “${c.title}”`);
    remove.onclick = () => {
      if (running && c.id === current.id) return;
      conversations = conversations.filter((x) => x.id !== c.id);
      keep();
      if (c.id === current.id) { current = newConversation(); renderConversation(); }
      renderList();
    };
    row.append(open, remove);
    return row;
  });
  $("conversations").replaceChildren(...items);
}

function keep() {
  const error = saveConversations(localStorage, conversations);
  if (error) status(error);
}

function remember() {
  conversations = upsert(conversations, current);
  keep();
  renderList();
}

function startNewChat() {
  if (running) return;
  current = newConversation();
  renderConversation();
  renderList();
  drawer(false);
  $("input").focus();
}

// ------------------------------------------------------------------ messages

function messageElement(message) {
  const article = document.createElement("article");
  article.className = `msg ${message.role}${message.error ? " error" : ""}`;
  const body = document.createElement("div");
  body.className = "body";
  if (message.reasoning) article.append(thinkingElement(message.reasoning));
  article.append(body);
  if (message.role === "assistant" && !message.error) renderMarkdown(body, message.content);
  else body.textContent = message.content;
  if (message.stats) {
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = message.stats;
    article.append(meta);
  }
  return article;
}

function thinkingElement(text) {
  const details = document.createElement("details");
  details.className = "thinking";
  const summary = document.createElement("summary");
  summary.textContent = "Thinking";
  const thought = document.createElement("div");
  thought.className = "thought";
  thought.textContent = text;
  details.append(summary, thought);
  return details;
}

function renderConversation() {
  $("log").replaceChildren(...(current.messages.length ? current.messages.map(messageElement) : [emptyState]));
  scrollDown(true);
  status("");
}

function scrollDown(force = false) {
  const log = $("log");
  if (force || log.scrollHeight - log.scrollTop - log.clientHeight < 120) log.scrollTop = log.scrollHeight;
}

const HINT = "Enter sends · Shift+Enter adds a line";

function status(text) {
  $("status").textContent = text || HINT;
  $("status").classList.toggle("hint", !text);
}

// ------------------------------------------------------------------ sending

async function send(event) {
  event?.preventDefault();
  const text = $("input").value.trim();
  if (!text || running) return;
  if (!settings.model) { status("No model to send to (see the message above)."); return; }
  $("input").value = "";
  grow();
  current.messages.push({ role: "user", content: text });
  remember();
  emptyState.remove();
  $("log").append(messageElement({ role: "user", content: text }));

  const model = settings.model;
  const reply = newReply();
  const view = streamingView();
  const times = { start: performance.now(), first: null, end: null };
  running = { controller: new AbortController(), replyId: null };
  busy(true);
  let stopped = false;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: running.controller.signal,
      body: JSON.stringify({ model, stream: true, stream_options: { include_usage: true },
                             temperature: settings.temperature, max_tokens: settings.max_tokens,
                             messages: apiMessages(current, settings.system) }),
    });
    if (!r.ok) throw new Error((await r.json().catch(() => ({}))).error?.message || `HTTP ${r.status}`);
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      const parsed = parseSSE(buffer + value);
      buffer = parsed.rest;
      for (const data of parsed.data) if (data !== "[DONE]") applyChunk(reply, JSON.parse(data));
      if (times.first === null && reply.pieces) times.first = performance.now();
      running.replyId = reply.id;
      view.update(reply);
    }
  } catch (e) {
    if (e.name !== "AbortError") {
      view.element.remove();
      current.messages.pop();  // the turn did not happen: its text goes back to the box, to send again
      remember();
      $("log").lastElementChild?.remove();
      $("input").value = text;
      grow();
      $("log").append(messageElement({ role: "assistant", content: e.message, error: true }));
      scrollDown(true);
      finish();
      return;
    }
    stopped = true;
  }
  times.end = performance.now();
  const message = { role: "assistant", content: reply.content + toolCallText(reply),
                    stats: replyStats(reply, model, times, stopped) };
  if (reply.reasoning) message.reasoning = reply.reasoning;
  current.messages.push(message);
  remember();
  view.element.replaceWith(messageElement(message));
  scrollDown();
  finish();
}

function toolCallText(reply) {
  return reply.toolCalls.map((c) => `\n\n\`${c.name}(${c.arguments})\``).join("");
}

// The reply being streamed: Markdown re-rendered at most once a frame (a long reply gets many chunks a frame).
function streamingView() {
  const element = document.createElement("article");
  element.className = "msg assistant";
  const body = document.createElement("div");
  body.className = "body caret";
  element.append(body);
  $("log").append(element);
  scrollDown(true);
  let pending = null;
  let thinking = null;
  return {
    element,
    update(reply) {
      if (pending) return;
      pending = requestAnimationFrame(() => {
        pending = null;
        if (reply.reasoning) {
          thinking ||= element.insertBefore(thinkingElement(""), body);
          thinking.open = !reply.content;
          thinking.querySelector(".thought").textContent = reply.reasoning;
        }
        renderMarkdown(body, reply.content + toolCallText(reply));
        $("thinking-bar").hidden = !(reply.reasoning && !reply.content && running);
        scrollDown();
      });
    },
  };
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  if (!on) $("thinking-bar").hidden = true;
}

function finish() {
  running = null;
  busy(false);
  $("input").focus();
}

function grow() {
  const input = $("input");
  input.style.height = "auto";
  input.style.height = `${input.scrollHeight + 2}px`;
}

function drawer(open) {
  document.body.classList.toggle("drawer", open);
  $("backdrop").hidden = !open;
}

// ------------------------------------------------------------------ wiring

wireSettings();
$("composer").onsubmit = send;
$("input").onkeydown = (e) => { if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e); };
$("input").oninput = grow;
$("stop").onclick = () => running?.controller.abort();
$("answer-now").onclick = () => running?.replyId && fetch("/v1/chat/completions/control", {
  method: "POST", headers: headers(), body: JSON.stringify({ id: running.replyId, action: "reasoning_end" }) });
$("new-chat").onclick = startNewChat;
$("menu").onclick = () => drawer(!document.body.classList.contains("drawer"));
$("backdrop").onclick = () => drawer(false);
window.addEventListener("storage", (e) => {  // another tab changed the list
  if (e.key === "goinfer-conversations") { conversations = loadConversations(localStorage); renderList(); }
});
if (conversations.length) current = conversations[0];
renderConversation();
renderList();
loadModels();
