// Video search page (semantic video search, end to end in the browser): embed a few clips
// with the embedding model, embed a query, rank the clips by cosine similarity.

import { call } from "./api.js";
import { el, say, table } from "./dom.js";
import { acceptFiles, contentPart, loadMedia, thumbnail } from "./media.js";

const $ = (id) => document.getElementById(id);

export function cosine(a, b) {
  let dot = 0;
  let na = 0;
  let nb = 0;
  for (let i = 0; i < a.length; i += 1) {
    dot += a[i] * b[i];
    na += a[i] * a[i];
    nb += b[i] * b[i];
  }
  return na && nb ? dot / Math.sqrt(na * nb) : 0;
}

const base64Of = (dataUrl) => dataUrl.slice(dataUrl.indexOf(",") + 1);

// Two ways in: OpenAI's /v1/embeddings (the server decodes the clip), or the GPU worker's
// endpoints (/encode-video with frames drawn here, /encode-text with its query prefix).
async function embedClip(item, model, mode) {
  if (mode === "worker") {
    if (!item.frames.length) throw new Error(`${item.name}: this browser cannot decode its frames`);
    const answer = await call("/encode-video", {
      json: { model, frames: item.frames.map(base64Of) },
    });
    return answer.embedding;
  }
  const messages = [{ role: "user", content: [contentPart(item)] }];
  const answer = await call("/v1/embeddings", { json: { model, messages } });
  return answer.data[0].embedding;
}

async function embedQuery(text, model, mode) {
  if (mode === "worker") return (await call("/encode-text", { json: { model, text } })).embedding;
  return (await call("/v1/embeddings", { json: { model, input: text } })).data[0].embedding;
}

export function setupSearch() {
  const list = $("search-clips");
  const status = $("search-status");
  const results = $("search-results");
  let clips = []; // {item, vector, node}

  function clipNode(item) {
    const state = el("span", { className: "clip-state" }, "embedding…");
    return { node: el("li", { dataset: { state: "pending" } }, thumbnail(item), state), state };
  }

  async function embedAll(items) {
    const model = $("search-model").value;
    const mode = $("search-mode").value;
    const added = items.map((item) => ({ item, vector: null, ...clipNode(item) }));
    clips.push(...added);
    list.append(...added.map((c) => c.node));
    say(status, `embedding ${added.length} clip(s)…`);
    for (const clip of added) {
      try {
        clip.vector = await embedClip(clip.item, model, mode);
        clip.state.textContent = `embedded (${clip.vector.length} dimensions)`;
        clip.node.dataset.state = "ready";
      } catch (error) {
        clip.state.textContent = `failed: ${error.message}`;
        clip.node.dataset.state = "failed";
      }
    }
    const ready = clips.filter((c) => c.vector).length;
    say(status, `${ready} clip(s) embedded with ${model}`);
  }

  async function addFiles(files) {
    const items = (await Promise.all(files.map(loadMedia))).filter(Boolean);
    if (items.length) await embedAll(items);
    else say(status, "only videos and images can be searched", "error");
  }

  async function search() {
    const query = $("search-query").value.trim();
    const ready = clips.filter((c) => c.vector);
    if (!query) return say(status, "type a query first", "error");
    if (!ready.length) return say(status, "add a few clips first", "error");
    say(status, "searching…");
    try {
      const vector = await embedQuery(query, $("search-model").value, $("search-mode").value);
      const ranked = ready
        .map((c) => ({ clip: c, score: cosine(vector, c.vector) }))
        .sort((a, b) => b.score - a.score);
      const rows = ranked.map((r, i) => [
        String(i + 1),
        thumbnail(r.clip.item),
        r.score.toFixed(4),
      ]);
      results.replaceChildren(
        table(`Clips ranked for “${query}”`, ["Rank", "Clip", "Cosine"], rows, "ranked"),
      );
      say(status, `${ranked.length} clip(s) ranked`);
    } catch (error) {
      say(status, `search failed: ${error.message}`, "error");
    }
  }

  $("search-files").addEventListener("change", (event) => {
    addFiles([...event.target.files]);
    event.target.value = "";
  });
  acceptFiles($("search-drop"), null, addFiles);
  $("search-form").addEventListener("submit", (event) => {
    event.preventDefault();
    search();
  });
  $("search-clear").addEventListener("click", () => {
    clips = [];
    list.replaceChildren();
    results.replaceChildren();
    say(status, "no clips");
  });
  // Changing the model or the endpoints makes old vectors incomparable: embed again.
  for (const id of ["search-model", "search-mode"]) {
    $(id).addEventListener("change", () => {
      const items = clips.map((c) => c.item);
      clips = [];
      list.replaceChildren();
      results.replaceChildren();
      if (items.length) embedAll(items);
    });
  }
}
