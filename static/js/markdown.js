// Model output → safe DOM: markdown-it (raw HTML off) → DOMPurify (allow-list)
// → code blocks with a language label and a copy button. Model output is
// untrusted, so nothing here ever assigns unsanitised HTML to the page.

import MarkdownIt from "../vendor/markdown-it/markdown-it.esm.min.js";
import createDOMPurify from "../vendor/dompurify/purify.es.js";
import hljs from "../vendor/highlight/highlight.min.js";

// What markdown-it can produce with html:false. No <img> (images are rendered
// as links below), no style, no forms.
const ALLOWED_TAGS = [
  "p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "s", "del",
  "code", "pre", "blockquote", "ul", "ol", "li", "a", "table", "thead", "tbody",
  "tr", "th", "td", "span", "sub", "sup",
];
const ALLOWED_ATTR = ["href", "title", "class", "start"];
const ALIGN = /^text-align:\s*(left|right|center)\s*;?$/;

/**
 * Build a renderer with its own markdown-it and DOMPurify instances.
 * @param {Window} win  the window whose document receives the nodes
 * @returns {{toFragment:(text:string)=>DocumentFragment, render:(el:HTMLElement, text:string)=>void}}
 *   `toFragment` parses markdown into a sanitised fragment with code-block
 *   chrome added; `render` replaces `el`'s children with it.
 */
export function createMarkdownRenderer(win) {
  const md = new MarkdownIt({
    html: false, // raw HTML in the text stays text
    linkify: true,
    breaks: true, // chat models write line-oriented text
    typographer: false,
    highlight: (code, lang) => highlightCode(code, lang),
  });
  // markdown-it aligns table cells with an inline style, which the page's CSP
  // forbids: use a class instead (DOMPurify then drops any style left).
  md.core.ruler.push("align_to_class", (state) => {
    for (const tok of state.tokens) {
      if (tok.type !== "th_open" && tok.type !== "td_open") continue;
      if (!tok.attrs) continue;
      const m = ALIGN.exec(tok.attrGet("style") || "");
      tok.attrs = tok.attrs.filter(([name]) => name !== "style");
      if (m) tok.attrJoin("class", `align-${m[1]}`);
    }
  });
  // Images become links to them: a reply must not make the browser fetch a URL
  // by itself (that would leak the chat to whoever the text names).
  md.renderer.rules.image = (tokens, idx) => {
    const tok = tokens[idx];
    const alt = tok.content || "image";
    return `<a href="${md.utils.escapeHtml(tok.attrGet("src") || "")}">${md.utils.escapeHtml(alt)}</a>`;
  };
  const purify = createDOMPurify(win);
  // Links leave the app in a new tab and pass nothing back to it.
  purify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A" && node.hasAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer nofollow");
    }
  });
  const config = {
    ALLOWED_TAGS,
    ALLOWED_ATTR,
    ALLOW_DATA_ATTR: false,
    RETURN_DOM_FRAGMENT: true,
  };

  /** @param {string} text */
  function toFragment(text) {
    const html = md.render(text);
    const frag = purify.sanitize(html, config);
    for (const pre of frag.querySelectorAll("pre")) decorateCodeBlock(win.document, pre);
    // A wide table scrolls sideways: keyboard users reach it by Tab, then scroll with the arrows.
    for (const table of frag.querySelectorAll("table")) table.tabIndex = 0;
    return frag;
  }

  return {
    toFragment,
    render(el, text) {
      el.replaceChildren(toFragment(text));
    },
  };
}

/**
 * Highlight one fenced block when its language is known; otherwise return ""
 * so that markdown-it escapes it itself. Guessing the language is skipped on
 * purpose: it runs every grammar and a streaming reply re-renders often.
 * @param {string} code
 * @param {string} lang
 * @returns {string} HTML made only of escaped text and hljs <span class> tags
 */
function highlightCode(code, lang) {
  const language = (lang || "").trim().toLowerCase();
  if (!language || !hljs.getLanguage(language)) return "";
  try {
    return hljs.highlight(code, { language, ignoreIllegals: true }).value;
  } catch {
    return "";
  }
}

/**
 * Wrap a <pre> in a figure with a header (language, Copy button). Built with
 * DOM calls, so no markup is parsed.
 * @param {Document} doc
 * @param {HTMLPreElement} pre
 */
function decorateCodeBlock(doc, pre) {
  const code = pre.querySelector("code");
  const langClass = code ? [...code.classList].find((c) => c.startsWith("language-")) : undefined;
  const lang = langClass ? langClass.slice("language-".length) : "";
  if (code) code.classList.add("hljs");
  const wrap = doc.createElement("div");
  wrap.className = "code-block";
  const head = doc.createElement("div");
  head.className = "code-head";
  const label = doc.createElement("span");
  label.className = "code-lang";
  label.textContent = lang || "text";
  const copy = doc.createElement("button");
  copy.type = "button";
  copy.className = "copy-code";
  copy.textContent = "Copy";
  copy.setAttribute("aria-label", `Copy ${lang || "code"} to clipboard`);
  head.append(label, copy);
  // The <pre> is the block's one scroller (long lines scroll sideways): focusable, so a
  // keyboard can scroll it too.
  pre.tabIndex = 0;
  pre.setAttribute("aria-label", `${lang || "text"} code`);
  pre.replaceWith(wrap);
  wrap.append(head, pre);
}

/**
 * Put text on the clipboard; falls back to a hidden textarea where the async
 * Clipboard API is missing (plain http on a LAN address is not a secure context).
 * @param {Document} doc
 * @param {string} text
 * @returns {Promise<boolean>} whether the copy succeeded
 */
export async function copyText(doc, text) {
  try {
    if (navigator.clipboard && window.isSecureContext) {
      await navigator.clipboard.writeText(text);
      return true;
    }
  } catch {
    // fall through to the legacy path
  }
  const ta = doc.createElement("textarea");
  ta.value = text;
  ta.setAttribute("readonly", "");
  ta.className = "offscreen";
  doc.body.append(ta);
  ta.select();
  let ok = false;
  try {
    ok = doc.execCommand("copy");
  } catch {
    ok = false;
  }
  ta.remove();
  return ok;
}
