// Answers as Markdown: marked (vendor/marked.esm.js) turns the text into HTML, DOMPurify
// (vendor/purify.min.js) sanitises it into a DOM fragment, and the fragment replaces the node's
// children: no HTML string ever reaches the page unsanitised, nor through an HTML property.
//
// Raw HTML in an answer is shown as text, not parsed (a model may echo a hostile page), and
// images are links (the CSP loads images from this origin only; a remote image would also
// tell its host who reads the answer). Links open in a new tab, without a referrer.

import { Marked } from "./vendor/marked.esm.js";

const ENTITIES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escape = (text) => String(text).replace(/[&<>"']/g, (c) => ENTITIES[c]);

const marked = new Marked({
  gfm: true,
  breaks: true, // a model's single newlines are line breaks, as in a chat
  renderer: {
    html: ({ text }) => escape(text),
    image: ({ href, text }) => `<a href="${escape(href)}">${escape(text || href)}</a>`,
  },
});

const PURIFY = {
  RETURN_DOM_FRAGMENT: true,
  FORBID_TAGS: ["style", "img", "svg", "math", "form", "iframe", "video", "audio", "source"],
  FORBID_ATTR: ["style", "srcset"],
  ALLOWED_URI_REGEXP: /^(?:https?:|mailto:)/i,
};

let purifier = null;

function purify() {
  if (!purifier) {
    purifier = globalThis.DOMPurify;
    purifier.addHook("afterSanitizeAttributes", (node) => {
      if (node.tagName === "A" && node.hasAttribute("href")) {
        node.setAttribute("target", "_blank");
        node.setAttribute("rel", "noopener noreferrer");
      }
    });
  }
  return purifier;
}

// Replace `node`'s children with `text` rendered as sanitised Markdown.
export function renderMarkdown(node, text) {
  const html = marked.parse(text || "");
  node.replaceChildren(purify().sanitize(html, PURIFY));
}

// Render at most once per frame while an answer streams in.
export function markdownLater(node) {
  let pending = null;
  let frame = 0;
  return (text) => {
    pending = text;
    if (frame) return;
    frame = requestAnimationFrame(() => {
      frame = 0;
      renderMarkdown(node, pending);
    });
  };
}
