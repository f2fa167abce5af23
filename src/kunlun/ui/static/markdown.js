// Markdown for the Playground's replies, built as DOM nodes: every piece of text goes in as a
// text node, so a model's output can never become HTML. What it reads: fenced code blocks,
// headings (#, ##, ###), bullet and numbered lists, blank-line paragraphs, and inline `code`,
// **bold**, *italic* and [links](https://...) (http and https only; others stay text).
"use strict";

function inline(parent, text) {
  const pattern = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\n]+\*)|(\[[^\]\n]+\]\([^)\s]+\))/g;
  let at = 0, m;
  while ((m = pattern.exec(text)) !== null) {
    if (m.index > at) parent.appendChild(document.createTextNode(text.slice(at, m.index)));
    const token = m[0];
    let node;
    if (m[1]) { node = document.createElement("code"); node.textContent = token.slice(1, -1); }
    else if (m[2]) { node = document.createElement("strong"); inline(node, token.slice(2, -2)); }
    else if (m[3]) { node = document.createElement("em"); inline(node, token.slice(1, -1)); }
    else {
      const cut = token.indexOf("](");
      const label = token.slice(1, cut), href = token.slice(cut + 2, -1);
      if (/^https?:\/\//i.test(href)) {
        node = document.createElement("a");
        node.setAttribute("href", href);
        node.setAttribute("rel", "noopener noreferrer");
        node.setAttribute("target", "_blank");
        node.textContent = label;
      } else {
        node = document.createTextNode(token);
      }
    }
    parent.appendChild(node);
    at = m.index + token.length;
  }
  if (at < text.length) parent.appendChild(document.createTextNode(text.slice(at)));
}

function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let i = 0, paragraph = [], list = null;
  const flush = () => {
    if (paragraph.length) {
      const p = document.createElement("p");
      inline(p, paragraph.join("\n"));
      out.appendChild(p);
      paragraph = [];
    }
    list = null;
  };
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
    if (fence) {  // a code block runs to its closing fence, or to the end while streaming
      flush();
      const code = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      const pre = document.createElement("pre"), el = document.createElement("code");
      if (fence[1]) el.dataset.lang = fence[1];
      el.textContent = code.join("\n");
      pre.appendChild(el);
      out.appendChild(pre);
      i++;
      continue;
    }
    const heading = line.match(/^(#{1,3})\s+(.*)$/);
    const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
    if (heading) {
      flush();
      const h = document.createElement("h" + (heading[1].length + 2));
      inline(h, heading[2]);
      out.appendChild(h);
    } else if (bullet || numbered) {
      if (paragraph.length) flush();
      const kind = bullet ? "ul" : "ol";
      if (!list || list.tagName.toLowerCase() !== kind) {
        list = document.createElement(kind);
        out.appendChild(list);
      }
      const item = document.createElement("li");
      inline(item, (bullet || numbered)[1]);
      list.appendChild(item);
    } else if (!line.trim()) {
      flush();
    } else {
      list = null;
      paragraph.push(line);
    }
    i++;
  }
  flush();
  return out;
}
