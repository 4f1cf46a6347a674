// Model replies as Markdown: marked (a CommonMark + GitHub parser) and DOMPurify (an HTML sanitizer), both
// vendored from their npm releases in ./vendor (tests/test_browser.py checks the bytes against npm). A reply is
// untrusted text: whatever HTML it carries goes through the sanitizer, links open in a new tab, and the page's
// Content-Security-Policy keeps scripts, inline styles and other origins' images out even if something slipped.

import { marked } from "./vendor/marked.esm.js";
import DOMPurify from "./vendor/purify.es.mjs";

marked.use({ gfm: true, breaks: false });
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

const FORBID_TAGS = ["style", "form", "input", "button", "textarea", "select", "iframe"];

export function renderMarkdown(element, text) {
  element.innerHTML = DOMPurify.sanitize(marked.parse(text), { FORBID_TAGS, FORBID_ATTR: ["style"] });
  for (const pre of element.querySelectorAll("pre")) addCopyButton(pre);
}

function addCopyButton(pre) {
  const code = pre.querySelector("code");
  const language = /language-([\w+#-]+)/.exec(code?.className || "")?.[1] || "code";
  const box = document.createElement("div");
  box.className = "code";
  const head = document.createElement("div");
  head.className = "code-head";
  const label = document.createElement("span");
  label.textContent = language;
  const button = document.createElement("button");
  button.type = "button";
  button.className = "copy";
  button.textContent = "Copy";
  button.onclick = async () => {
    button.textContent = (await copyText((code || pre).textContent)) ? "Copied" : "Select and copy";
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  };
  head.append(label, button);
  pre.replaceWith(box);
  box.append(head, pre);
}

// The clipboard API exists only in secure contexts (https, localhost): a page served on a LAN address over http
// falls back to the older selection copy.
async function copyText(text) {
  try {
    if (navigator.clipboard && window.isSecureContext) {
      await navigator.clipboard.writeText(text);
      return true;
    }
  } catch { /* fall through */ }
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.className = "offscreen";
  document.body.append(area);
  area.select();
  const ok = document.execCommand("copy");
  area.remove();
  return ok;
}
