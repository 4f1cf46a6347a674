// goinfer's built-in chat page (GET /): the OpenAI chat API of this server, streamed.
// parseSSE and applyChunk are pure (tests/test_web.py runs them under node on the server's real stream);
// the rest wires them to the page when there is one.

// Server-sent events: (text so far) -> {data: [payload strings], rest: the unfinished tail}
export function parseSSE(text) {
  const data = [];
  const blocks = text.split(/\r?\n\r?\n/);
  const rest = blocks.pop();
  for (const block of blocks) {
    const lines = block.split(/\r?\n/).filter((l) => l.startsWith("data:"));
    if (lines.length) data.push(lines.map((l) => l.slice(5).replace(/^ /, "")).join("\n"));
  }
  return { data, rest };
}

// One chat.completion.chunk into the reply being built: {content, reasoning, toolCalls, finish, usage}
export function applyChunk(reply, chunk) {
  if (chunk.id) reply.id = chunk.id;
  if (chunk.usage) reply.usage = chunk.usage;
  for (const choice of chunk.choices || []) {
    const d = choice.delta || {};
    if (d.content) reply.content += d.content;
    if (d.reasoning_content) reply.reasoning += d.reasoning_content;
    for (const call of d.tool_calls || []) {
      const slot = (reply.toolCalls[call.index] ||= { name: "", arguments: "" });
      if (call.function?.name) slot.name = call.function.name;
      if (call.function?.arguments) slot.arguments += call.function.arguments;
    }
    if (choice.finish_reason) reply.finish = choice.finish_reason;
  }
  return reply;
}

export function newReply() {
  return { id: null, content: "", reasoning: "", toolCalls: [], finish: null, usage: null };
}

// ------------------------------------------------------------------ the page

function page() {
  const $ = (id) => document.getElementById(id);
  const key = () => localStorage.getItem("goinfer-key") || "";
  const headers = () => ({ "Content-Type": "application/json", ...(key() ? { Authorization: `Bearer ${key()}` } : {}) });
  const messages = [];
  let controller = null;
  let current = null;  // the running reply's id: what "answer now" names

  $("key").value = key();
  $("key").onchange = () => { localStorage.setItem("goinfer-key", $("key").value.trim()); loadModels(); };

  async function loadModels() {
    try {
      const r = await fetch("/v1/models", { headers: headers() });
      const body = await r.json();
      if (!r.ok) throw new Error(body.error?.message || r.statusText);
      $("model").innerHTML = "";
      for (const m of body.data.filter((m) => m.type !== "embedding")) {
        const o = document.createElement("option");
        o.value = o.textContent = m.id;
        $("model").append(o);
      }
      status("");
    } catch (e) { status(`models: ${e.message} (an API key may be needed)`); }
  }

  function status(text) { $("status").textContent = text; }

  function bubble(role, text = "") {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    div.textContent = text;
    $("log").append(div);
    div.scrollIntoView({ block: "end" });
    return div;
  }

  async function send(event) {
    event.preventDefault();
    const text = $("input").value.trim();
    if (!text || controller) return;
    $("input").value = "";
    messages.push({ role: "user", content: text });
    bubble("user", text);
    const thought = document.createElement("details");
    thought.className = "thinking";
    thought.innerHTML = "<summary>thinking</summary><div></div>";
    const out = bubble("assistant");
    const reply = newReply();
    const system = $("system").value.trim();
    const body = {
      model: $("model").value, stream: true, stream_options: { include_usage: true },
      temperature: Number($("temp").value), max_tokens: Number($("max").value),
      messages: system ? [{ role: "system", content: system }, ...messages] : [...messages],
    };
    controller = new AbortController();
    $("stop").disabled = false;
    try {
      const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
                                                      signal: controller.signal });
      if (!r.ok) throw new Error((await r.json()).error?.message || r.statusText);
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        const parsed = parseSSE(buffer + value);
        buffer = parsed.rest;
        for (const data of parsed.data) {
          if (data === "[DONE]") continue;
          applyChunk(reply, JSON.parse(data));
        }
        if (reply.reasoning && !thought.isConnected) out.before(thought);
        $("answer").disabled = !(reply.reasoning && !reply.content);
        current = reply.id;
        thought.querySelector("div").textContent = reply.reasoning;
        out.textContent = reply.content + reply.toolCalls.map((c) => `\n[call ${c.name}(${c.arguments})]`).join("");
        out.scrollIntoView({ block: "end" });
      }
      messages.push({ role: "assistant", content: reply.content });
      const u = reply.usage;
      status(u ? `${u.prompt_tokens} prompt + ${u.completion_tokens} completion tokens` +
                 (reply.finish === "length" ? " (stopped at max tokens)" : "") : "");
    } catch (e) {
      if (e.name === "AbortError") { messages.push({ role: "assistant", content: reply.content }); status("stopped"); }
      else { out.classList.add("error"); out.textContent = e.message; messages.pop(); }
    } finally {
      controller = null;
      current = null;
      $("stop").disabled = $("answer").disabled = true;
    }
  }

  $("form").onsubmit = send;
  $("stop").onclick = () => controller?.abort();
  $("answer").onclick = () => current && fetch("/v1/chat/completions/control", {
    method: "POST", headers: headers(), body: JSON.stringify({ id: current, action: "reasoning_end" }) });
  $("reset").onclick = () => { messages.length = 0; $("log").innerHTML = ""; status(""); };
  $("input").onkeydown = (e) => { if (e.key === "Enter" && !e.shiftKey) send(e); };
  loadModels();
}

if (typeof document !== "undefined") page();
