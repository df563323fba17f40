// A number written with an exponent stays on one line in a table cell: a browser may otherwise break
// it after the minus of its exponent ("1.1e-" / "11"). Each one is wrapped in a span.nowrap
// (_static/fit.css); text that MathJax will typeset is left alone.
document.addEventListener("DOMContentLoaded", () => {
  const number = /-?\d+(?:\.\d+)?e[+-]\d+/g;
  for (const cell of document.querySelectorAll(".bd-article td, .bd-article th")) {
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    const nodes = [];
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      const text = node.textContent;
      if (number.test(text) && !/\\\(|\$/.test(text) && !node.parentElement.closest("code, mjx-container")) nodes.push(node);
      number.lastIndex = 0;
    }
    for (const node of nodes) {
      const parts = document.createDocumentFragment();
      let at = 0;
      for (const match of node.textContent.matchAll(number)) {
        parts.append(node.textContent.slice(at, match.index));
        const span = document.createElement("span");
        span.className = "nowrap";
        span.textContent = match[0];
        parts.append(span);
        at = match.index + match[0].length;
      }
      parts.append(node.textContent.slice(at));
      node.replaceWith(parts);
    }
  }
});
