// Small DOM helpers shared by the pages.

// el("td", {className: "x", dataset: {k: "v"}}, "text", child) -> an element.
export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (name === "dataset") Object.assign(node.dataset, value);
    else if (name in node) node[name] = value;
    else node.setAttribute(name, value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

// A table with a caption, a header row and rows of cells (strings or nodes).
export function table(caption, headers, rows, className = "") {
  const head = el("tr", {}, ...headers.map((h) => el("th", { scope: "col" }, h)));
  const body = rows.map((cells) => {
    const row = cells.row ? cells : { cells, row: {} };
    return el("tr", row.row, ...row.cells.map((c) => el("td", {}, c)));
  });
  return el(
    "div",
    { className: "table-wrap" },
    el(
      "table",
      { className },
      el("caption", {}, caption),
      el("thead", {}, head),
      el("tbody", {}, ...body),
    ),
  );
}

// Raw JSON folded under the result.
export function rawJson(data, label = "Raw JSON") {
  return el(
    "details",
    { className: "raw" },
    el("summary", {}, label),
    el("pre", {}, JSON.stringify(data, null, 2)),
  );
}

// A polite status line (screen readers announce it); kind: "info" | "error".
export function say(node, text, kind = "info") {
  node.textContent = text;
  node.dataset.kind = kind;
}

export function fmtBytes(bytes) {
  if (bytes === null || bytes === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

export function fmtSeconds(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  if (seconds < 0) return "forever";
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 120) return `${seconds.toFixed(1)} s`;
  if (seconds < 7200) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

// "12 s ago" for a unix time.
export function fmtAgo(unix) {
  if (!unix) return "never";
  return `${fmtSeconds(Math.max(0, Date.now() / 1000 - unix))} ago`;
}
