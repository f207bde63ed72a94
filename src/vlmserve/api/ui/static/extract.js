// Extract page: an image or text in; entities, triples or an ID card (KTP) out, as a table
// (ID cards with each field's validation flag) and the raw JSON.

import { call } from "./api.js";
import { el, rawJson, say, table } from "./dom.js";
import { acceptFiles, loadMedia, thumbnail } from "./media.js";

const $ = (id) => document.getElementById(id);

// KTP fields, flattened as the server's `validation` names them ("alamat.rt_rw").
function cardRows(answer) {
  const rows = [];
  for (const [name, check] of Object.entries(answer.validation || {})) {
    const [head, sub] = name.split(".");
    const value = sub ? answer[head]?.[sub] : answer[head];
    const ok = check.valid;
    const flag = el(
      "span",
      { className: ok ? "flag ok" : "flag bad" },
      ok ? "✓ valid" : `✗ ${check.reason || "invalid"}`,
    );
    rows.push({
      row: { className: ok ? "" : "invalid", dataset: { field: name } },
      cells: [name, value === null || value === undefined ? "—" : String(value), flag],
    });
  }
  return rows;
}

function render(task, answer) {
  if (task === "id-card") {
    const verdict = answer.valid
      ? "every field passed its checks"
      : "some fields failed their checks";
    return table(
      `ID card (KTP): ${verdict}`,
      ["Field", "Value", "Check"],
      cardRows(answer),
      "fields",
    );
  }
  if (answer.result !== undefined)
    return el("p", {}, "A custom schema's answer: see the raw JSON.");
  if (task === "entities") {
    return table(
      "Entities",
      ["Text", "Type"],
      answer.entities.map((e) => [e.text, e.type]),
      "entities",
    );
  }
  return table(
    "Triples",
    ["Subject", "Predicate", "Object"],
    answer.triples.map((t) => [t.subject, t.predicate, t.object]),
    "triples",
  );
}

export function setupExtract() {
  const status = $("extract-status");
  const output = $("extract-output");
  const preview = $("extract-preview");
  const run = $("extract-run");
  let image = null;

  async function setImage(files) {
    const items = (await Promise.all(files.map(loadMedia))).filter((i) => i && i.kind === "image");
    image = items[0] || null;
    preview.replaceChildren(...(image ? [thumbnail(image)] : []));
    say(
      status,
      image ? `image: ${image.name}` : "only images can be read here",
      image ? "info" : "error",
    );
  }

  async function extract() {
    const task = $("extract-task").value;
    const text = $("extract-text").value.trim();
    const model = $("extract-model").value || undefined;
    let body;
    if (task === "id-card") {
      if (!image) return say(status, "an ID card needs an image", "error");
      body = { model, image: image.dataUrl };
    } else {
      if (!text && !image) return say(status, "give a text or an image", "error");
      body = { model, text: text || undefined, images: image ? [image.dataUrl] : [] };
    }
    run.disabled = true;
    output.replaceChildren();
    output.dataset.state = "running";
    say(status, "extracting…");
    const started = performance.now();
    try {
      const answer = await call(`/v1/extract/${task}`, { json: body });
      output.replaceChildren(render(task, answer), rawJson(answer));
      output.dataset.state = "done";
      const seconds = ((performance.now() - started) / 1000).toFixed(1);
      say(
        status,
        `done in ${seconds} s by ${answer.model} (${answer.usage?.total_tokens ?? "?"} tokens)`,
      );
    } catch (error) {
      output.dataset.state = "error";
      if (error.body) output.replaceChildren(rawJson(error.body, "Error JSON"));
      say(status, `extraction failed: ${error.message}`, "error");
    } finally {
      run.disabled = false;
    }
  }

  $("extract-file").addEventListener("change", (event) => {
    setImage([...event.target.files]);
    event.target.value = "";
  });
  acceptFiles($("extract-drop"), $("extract-text"), setImage);
  $("extract-clear").addEventListener("click", () => {
    image = null;
    preview.replaceChildren();
    say(status, "no image");
  });
  $("extract-task").addEventListener("change", () => {
    $("extract-text-field").hidden = $("extract-task").value === "id-card";
  });
  $("extract-form").addEventListener("submit", (event) => {
    event.preventDefault();
    extract();
  });
}
