// The chat page's stream reader: the OpenAI chat API's server-sent events into the reply being built.
// Pure functions (no page, no network): tests/test_web.py runs them under node on the server's real stream.

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

export function newReply() {
  return { id: null, content: "", reasoning: "", toolCalls: [], finish: null, usage: null, pieces: 0 };
}

// One chat.completion.chunk into the reply: {content, reasoning, toolCalls, finish, usage}. `pieces` counts the
// chunks that carried text, the token count of a reply stopped before the server sent its usage.
export function applyChunk(reply, chunk) {
  if (chunk.id) reply.id = chunk.id;
  if (chunk.usage) reply.usage = chunk.usage;
  for (const choice of chunk.choices || []) {
    const d = choice.delta || {};
    if (d.content || d.reasoning_content || d.tool_calls) reply.pieces += 1;
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

// The line under a finished reply: model, tokens, decode speed (tokens after the first, over the time after the
// first: what the user waits for per token), time to the first token, and why it ended where that is news.
// times: {start, first, end} in milliseconds.
export function replyStats(reply, model, times, stopped) {
  const tokens = reply.usage?.completion_tokens ?? reply.pieces;
  const parts = [model, `${tokens} token${tokens === 1 ? "" : "s"}`];
  if (times.first != null && tokens > 1 && times.end > times.first) {
    parts.push(`${((tokens - 1) / ((times.end - times.first) / 1000)).toFixed(1)} tokens/s`);
  }
  if (times.first != null) parts.push(`first token after ${duration(times.first - times.start)}`);
  if (stopped) parts.push("stopped");
  else if (reply.finish === "length") parts.push("cut at max tokens");
  return parts.filter(Boolean).join(" · ");
}

function duration(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(1)} s`;
}
