// Video search page (semantic video search, end to end in the browser): embed a few clips
// with the embedding model, embed a query, rank the clips by cosine similarity; optionally
// reorder the top RERANK_TOP by a reranker's relevance (/v1/rerank, each clip with its name).

import { call, listModels } from "./api.js";
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

export const RERANK_TOP = 20;

// The clip as a rerank document: its image or video, and its file name as text.
function rerankDocument(item) {
  const media = item.kind === "image" ? { image: item.dataUrl } : { video: item.dataUrl };
  return { ...media, text: item.name };
}

// The cosine ranking's first RERANK_TOP reordered by the reranker; the rest keep their order.
async function rerank(query, ranked, model) {
  const top = ranked.slice(0, RERANK_TOP);
  const documents = top.map((r) => rerankDocument(r.clip.item));
  const answer = await call("/v1/rerank", { json: { model, query, documents } });
  const reordered = answer.results.map((r) => ({ ...top[r.index], relevance: r.relevance_score }));
  return [...reordered, ...ranked.slice(RERANK_TOP)];
}

// Models that score pairs with a cross-encoder (role "rerank"); refreshed when the select is
// opened, so that a key typed later (or a model added) shows up.
async function fillRerankers(select) {
  let models = [];
  try {
    models = (await listModels()).filter((m) => m.scores && (m.roles || []).includes("rerank"));
  } catch {
    return;
  }
  const before = select.value;
  const none = el("option", { value: "" }, "no rerank (cosine only)");
  select.replaceChildren(none, ...models.map((m) => el("option", { value: m.id }, m.id)));
  if (models.some((m) => m.id === before)) select.value = before;
  select.dataset.loaded = String(models.length);
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
      let ranked = ready
        .map((c) => ({ clip: c, score: cosine(vector, c.vector) }))
        .sort((a, b) => b.score - a.score);
      const reranker = $("search-reranker").value;
      if (reranker) ranked = await rerank(query, ranked, reranker);
      const rows = ranked.map((r, i) => [
        String(i + 1),
        thumbnail(r.clip.item),
        r.score.toFixed(4),
        ...(reranker ? [r.relevance === undefined ? "–" : r.relevance.toFixed(4)] : []),
      ]);
      const headers = ["Rank", "Clip", "Cosine", ...(reranker ? ["Rerank"] : [])];
      const caption = `Clips ranked for “${query}”${reranker ? `, reranked by ${reranker}` : ""}`;
      const className = reranker ? "ranked reranked" : "ranked";
      results.replaceChildren(table(caption, headers, rows, className));
      say(status, `${ranked.length} clip(s) ranked${reranker ? ` (top ${RERANK_TOP} reranked)` : ""}`);
    } catch (error) {
      say(status, `search failed: ${error.message}`, "error");
    }
  }

  const rerankers = $("search-reranker");
  fillRerankers(rerankers);
  rerankers.addEventListener("focus", () => {
    if (rerankers.dataset.loaded !== undefined && rerankers.dataset.loaded !== "0") return;
    fillRerankers(rerankers);
  });
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
