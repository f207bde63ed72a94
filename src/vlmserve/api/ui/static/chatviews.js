// The chat log's messages: a question (its attachments and text), an answer (its reasoning,
// folded; its text as Markdown; an error; a line of facts), and the buttons under each.

import { el, fmtSeconds, say } from "./dom.js";
import { markdownLater, renderMarkdown } from "./markdown.js";
import { thumbnail } from "./media.js";

// buttons: [{label, name, onClick}] -> a row of small buttons under a message.
function actionRow(buttons) {
  const row = el("div", { className: "msg-actions" });
  for (const { label, name, onClick } of buttons) {
    const button = el("button", { type: "button", className: "small" }, label);
    button.dataset.action = name;
    button.addEventListener("click", onClick);
    row.append(button);
  }
  return row;
}

export function userView(turn, buttons) {
  const media = turn.media || [];
  const thumbs = media.length ? el("div", { className: "thumbs" }, ...media.map(thumbnail)) : null;
  const text = turn.text ? el("div", { className: "content" }, turn.text) : null;
  return el("li", { className: "msg user" }, thumbs, text, actionRow(buttons));
}

// The question turned into a form: its text in a textarea, Save and resend, Cancel.
export function editorView(turn, { onSave, onCancel }) {
  const area = el("textarea", { className: "edit-text", rows: 3 });
  area.value = turn.text;
  area.setAttribute("aria-label", "Edit the message");
  const save = el("button", { type: "submit", className: "primary small" }, "Save and resend");
  const cancel = el("button", { type: "button", className: "small" }, "Cancel");
  const form = el("form", { className: "msg-edit" }, area, el("div", {}, save, " ", cancel));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    onSave(area.value.trim());
  });
  cancel.addEventListener("click", onCancel);
  const media = turn.media || [];
  const thumbs = media.length ? el("div", { className: "thumbs" }, ...media.map(thumbnail)) : null;
  const node = el("li", { className: "msg user editing" }, thumbs, form);
  queueMicrotask(() => area.focus());
  return node;
}

// One answer: built from a finished turn, or streamed into (addText / addReasoning / fail).
export class AnswerView {
  constructor(turn, buttons = []) {
    this.reasoning = el("pre", { className: "reasoning-text" }, turn.reasoning || "");
    this.details = el(
      "details",
      { className: "reasoning", hidden: !turn.reasoning },
      el("summary", {}, "Reasoning"),
      this.reasoning,
    );
    this.text = el("div", { className: "content markdown" });
    this.meta = el("p", { className: "meta" });
    this.error = el("p", { className: "error", role: "alert", hidden: !turn.error });
    this.error.textContent = turn.error || "";
    this.actions = actionRow(buttons);
    const state = turn.state || "streaming";
    const props = { className: "msg assistant", dataset: { state }, "aria-busy": "false" };
    if (turn.resumed) props.dataset.resumed = String(turn.resumed);
    this.node = el("li", props, this.details, this.text, this.error, this.meta, this.actions);
    if (state === "streaming") {
      this.node.setAttribute("aria-busy", "true");
      say(this.meta, "waiting for the first token…");
    } else {
      say(this.meta, turn.meta || "");
    }
    this.render = markdownLater(this.text);
    if (turn.text) renderMarkdown(this.text, turn.text);
  }

  addReasoning(text) {
    this.details.hidden = false;
    this.reasoning.textContent += text;
  }

  fail(message) {
    this.error.hidden = false;
    this.error.textContent = message;
  }
}

// "TTFT 120 ms · 12 prompt + 40 completion tokens · 85.0 tokens/s · finish: stop".
export function facts(run) {
  const parts = [];
  if (run.state === "cancelled") parts.push("stopped");
  if (run.ttft !== null) parts.push(`TTFT ${fmtSeconds(run.ttft)}`);
  const usage = run.usage;
  if (usage) {
    parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
    const seconds = run.lastAt && run.firstAt ? (run.lastAt - run.firstAt) / 1000 : 0;
    if (seconds > 0 && usage.completion_tokens > 1) {
      parts.push(`${((usage.completion_tokens - 1) / seconds).toFixed(1)} tokens/s`);
    }
  }
  if (run.finish && run.finish !== "cancelled") parts.push(`finish: ${run.finish}`);
  if (run.resumes)
    parts.push(`resumed after a dropped connection${run.resumes > 1 ? ` (${run.resumes}×)` : ""}`);
  return parts.join(" · ");
}
