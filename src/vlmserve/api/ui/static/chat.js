// Chat page: a model, text plus images and videos, a streamed answer that resumes by itself
// after a dropped connection, a stop button, and usage and TTFT under each answer.

import { el, fmtSeconds, say } from "./dom.js";
import { acceptFiles, contentPart, loadMedia, thumbnail } from "./media.js";
import { ChatStream } from "./stream.js";

const $ = (id) => document.getElementById(id);

// One answer in the log: its reasoning (folded), its text, and a line of facts under it.
class AnswerView {
  constructor(log) {
    this.reasoning = el("pre", { className: "reasoning-text" });
    this.details = el(
      "details",
      { className: "reasoning", hidden: true },
      el("summary", {}, "Reasoning"),
      this.reasoning,
    );
    this.text = el("div", { className: "content" });
    this.meta = el("p", { className: "meta" });
    this.error = el("p", { className: "error", role: "alert", hidden: true });
    const props = {
      className: "msg assistant",
      dataset: { state: "streaming" },
      "aria-busy": "true",
    };
    this.node = el("li", props, this.details, this.text, this.error, this.meta);
    log.append(this.node);
    say(this.meta, "waiting for the first token…");
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

function userView(log, text, media) {
  const thumbs = media.length ? el("div", { className: "thumbs" }, ...media.map(thumbnail)) : null;
  log.append(
    el(
      "li",
      { className: "msg user" },
      thumbs,
      text ? el("div", { className: "content" }, text) : null,
    ),
  );
}

function facts(run) {
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

export function setupChat() {
  const log = $("chat-log");
  const input = $("chat-input");
  const files = $("chat-files");
  const tray = $("chat-attachments");
  const send = $("chat-send");
  const stop = $("chat-stop");
  const status = $("chat-status");
  const newChat = $("chat-new");
  let history = [];
  let pending = [];
  let current = null;

  function renderTray() {
    tray.replaceChildren(
      ...pending.map((item, i) => {
        const remove = el(
          "button",
          { type: "button", className: "remove", "aria-label": `Remove ${item.name}` },
          "×",
        );
        remove.addEventListener("click", () => {
          pending.splice(i, 1);
          renderTray();
        });
        return el("li", {}, thumbnail(item), remove);
      }),
    );
  }

  async function addFiles(list) {
    say(status, "reading files…");
    const items = (await Promise.all(list.map(loadMedia))).filter(Boolean);
    pending.push(...items);
    renderTray();
    const skipped = list.length - items.length;
    say(
      status,
      skipped
        ? `${skipped} file(s) skipped: only images and videos`
        : `${pending.length} attachment(s)`,
    );
  }

  async function submit() {
    const text = input.value.trim();
    if ((!text && !pending.length) || current) return;
    const media = pending;
    const content = media.length
      ? [...media.map(contentPart), ...(text ? [{ type: "text", text }] : [])]
      : text;
    history.push({ role: "user", content });
    userView(log, text, media);
    input.value = "";
    pending = [];
    renderTray();
    const body = {
      model: $("chat-model").value,
      messages: [...history],
      max_tokens: Number($("chat-max-tokens").value) || undefined,
      temperature: Number($("chat-temperature").value),
    };
    await answer(body);
  }

  async function answer(body) {
    const view = new AnswerView(log);
    const run = {
      state: "streaming",
      ttft: null,
      usage: null,
      finish: null,
      resumes: 0,
      firstAt: 0,
      lastAt: 0,
      text: "",
    };
    const started = performance.now();
    const seen = () => {
      const now = performance.now();
      if (run.ttft === null) {
        run.ttft = (now - started) / 1000;
        run.firstAt = now;
      }
      run.lastAt = now;
    };
    current = new ChatStream(body, {
      onChunk(chunk) {
        if (chunk.usage) run.usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          const thought = delta.reasoning ?? delta.reasoning_content;
          if (thought) {
            seen();
            view.addReasoning(thought);
          }
          if (delta.content) {
            seen();
            run.text += delta.content;
            view.text.textContent = run.text;
          }
          if (choice.finish_reason) run.finish = choice.finish_reason;
        }
        say(view.meta, facts(run) || "streaming…");
        log.scrollTop = log.scrollHeight;
      },
      onError(error) {
        view.fail(error.message || JSON.stringify(error));
      },
      onResume(count) {
        run.resumes = count;
        view.node.dataset.resumed = String(count);
        say(view.meta, facts(run));
      },
    });
    send.disabled = newChat.disabled = true;
    stop.disabled = false;
    try {
      await current.run();
      run.state = run.finish === "cancelled" ? "cancelled" : "done";
    } catch (error) {
      run.state = error.name === "AbortError" ? "cancelled" : "error";
      if (run.state === "error") view.fail(error.message);
    } finally {
      current = null;
      send.disabled = newChat.disabled = false;
      stop.disabled = true;
    }
    if (!view.error.hidden && run.state === "done") run.state = "error";
    if (run.state === "error" && !run.text)
      history.pop(); // nothing came back: retry the turn
    else history.push({ role: "assistant", content: run.text });
    say(view.meta, facts(run));
    view.node.dataset.state = run.state;
    view.node.setAttribute("aria-busy", "false");
    const said = {
      done: "answer complete",
      cancelled: "answer stopped",
      error: "the answer failed",
    };
    say(status, `${said[run.state]}: ${facts(run)}`, run.state === "error" ? "error" : "info");
    input.focus();
  }

  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    submit();
  });
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      submit();
    }
  });
  stop.addEventListener("click", async () => {
    if (!current) return;
    stop.disabled = true;
    try {
      await current.cancel();
    } catch (error) {
      // a 404 means it had just ended
      if (error.status !== 404) say(status, `stop failed: ${error.message}`, "error");
    }
  });
  files.addEventListener("change", () => {
    addFiles([...files.files]);
    files.value = "";
  });
  acceptFiles($("chat-drop"), input, addFiles);
  newChat.addEventListener("click", () => {
    history = [];
    log.replaceChildren();
    say(status, "new conversation");
  });
}
