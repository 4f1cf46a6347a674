// Conversations kept in the browser's storage (never on the server): a list, newest first, each
// {id, title, updated, messages: [{role, content, reasoning?, stats?}]}. Pure over a Storage-like object, so
// node can run them; the page passes localStorage.

const KEY = "goinfer-conversations";
const TITLE_CHARS = 48;

export function loadConversations(storage) {
  try {
    const list = JSON.parse(storage.getItem(KEY) || "[]");
    return Array.isArray(list) ? list.filter((c) => c && c.id && Array.isArray(c.messages)) : [];
  } catch {
    return [];  // a damaged entry (edited by hand, another version) must not break the page
  }
}

// Returns an error message when the browser refuses (storage full), null when saved.
export function saveConversations(storage, list) {
  try {
    storage.setItem(KEY, JSON.stringify(list));
    return null;
  } catch (e) {
    return `could not keep the conversation in this browser (${e.name})`;
  }
}

export function newConversation(now = Date.now()) {
  return { id: `c${now.toString(36)}${Math.random().toString(36).slice(2, 8)}`, title: "New chat", updated: now,
           messages: [] };
}

export function titleFor(text) {
  const line = text.trim().split("\n")[0].trim();
  return line.length > TITLE_CHARS ? `${line.slice(0, TITLE_CHARS - 1).trimEnd()}…` : line || "New chat";
}

// Put a conversation first (it was just used) in place of its older copy; empty ones are not kept.
export function upsert(list, conversation, now = Date.now()) {
  conversation.updated = now;
  if (conversation.title === "New chat") {
    const first = conversation.messages.find((m) => m.role === "user");
    if (first) conversation.title = titleFor(first.content);
  }
  const rest = list.filter((c) => c.id !== conversation.id);
  return conversation.messages.length ? [conversation, ...rest] : rest;
}

// The request's messages: the system prompt (a setting, not part of the conversation), then the turns.
export function apiMessages(conversation, system) {
  const turns = conversation.messages.map((m) => ({ role: m.role, content: m.content }));
  return system ? [{ role: "system", content: system }, ...turns] : turns;
}
