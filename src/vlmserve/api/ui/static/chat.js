// Chat page: a model, a system prompt, text plus images and videos, a streamed answer (as
// Markdown) that resumes by itself after a dropped connection, a stop button, and usage and
// TTFT under each answer. The conversation survives a reload of the tab (conversation.js);
// each message can be copied, a question edited and sent again, the last answer regenerated.

import { Conversation } from "./conversation.js";
import { AnswerView, editorView, facts, userView } from "./chatviews.js";
import { el, say } from "./dom.js";
import { acceptFiles, loadMedia, thumbnail } from "./media.js";
import { ChatStream } from "./stream.js";

const $ = (id) => document.getElementById(id);

// Streams one answer into `view`; resolves to the finished assistant turn.
async function streamAnswer(body, view, handles) {
  const run = { state: "streaming", ttft: null, usage: null, finish: null, resumes: 0 };
  Object.assign(run, { firstAt: 0, lastAt: 0, text: "", reasoning: "", error: "" });
  const started = performance.now();
  const seen = () => {
    const now = performance.now();
    if (run.ttft === null) [run.ttft, run.firstAt] = [(now - started) / 1000, now];
    run.lastAt = now;
  };
  const fail = (message) => {
    run.error = message || "the request failed";
    view.fail(run.error);
  };
  handles.current = new ChatStream(body, {
    onChunk(chunk) {
      if (chunk.usage) run.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        const thought = delta.reasoning ?? delta.reasoning_content;
        if (thought) {
          seen();
          run.reasoning += thought;
          view.addReasoning(thought);
        }
        if (delta.content) {
          seen();
          run.text += delta.content;
          view.render(run.text);
        }
        if (choice.finish_reason) run.finish = choice.finish_reason;
      }
      say(view.meta, facts(run) || "streaming…");
      handles.scroll();
    },
    onError: (error) => fail(error.message || JSON.stringify(error)),
    onResume(count) {
      run.resumes = count;
      view.node.dataset.resumed = String(count);
      say(view.meta, facts(run));
    },
  });
  try {
    await handles.current.run();
    run.state = run.finish === "cancelled" ? "cancelled" : "done";
  } catch (error) {
    run.state = error.name === "AbortError" ? "cancelled" : "error";
    if (run.state === "error") fail(error.message);
  }
  if (run.error && run.state === "done") run.state = "error";
  const { text, reasoning, state, error, resumes } = run;
  return { role: "assistant", text, reasoning, state, error, resumed: resumes, meta: facts(run) };
}

export function setupChat() {
  const log = $("chat-log");
  const input = $("chat-input");
  const tray = $("chat-attachments");
  const status = $("chat-status");
  const system = $("chat-system");
  const convo = new Conversation();
  const handles = { current: null, scroll: () => (log.scrollTop = log.scrollHeight) };
  let pending = [];

  function save() {
    if (!convo.save()) say(status, "attachments too large to keep across a reload: left out");
  }

  function setBusy(busy) {
    $("chat-send").disabled = $("chat-new").disabled = busy;
    $("chat-stop").disabled = !busy;
    for (const button of log.querySelectorAll(".msg-actions button")) button.disabled = busy;
  }

  function copy(text) {
    navigator.clipboard.writeText(text).then(
      () => say(status, "copied"),
      (error) => say(status, `copy failed: ${error.message}`, "error"),
    );
  }

  function buttonsFor(i) {
    const turn = convo.turns[i];
    const buttons = [{ label: "Copy", name: "copy", onClick: () => copy(turn.text) }];
    if (turn.role === "user") buttons.push({ label: "Edit", name: "edit", onClick: () => edit(i) });
    else if (i === convo.turns.length - 1)
      buttons.push({ label: "Regenerate", name: "regenerate", onClick: () => regenerate(i) });
    return buttons;
  }

  function viewOf(turn, i) {
    return turn.role === "user"
      ? userView(turn, buttonsFor(i))
      : new AnswerView(turn, buttonsFor(i)).node;
  }

  function render() {
    log.replaceChildren(...convo.turns.map(viewOf));
    handles.scroll();
  }

  async function ask() {
    const body = {
      model: $("chat-model").value,
      messages: convo.messages(),
      max_tokens: Number($("chat-max-tokens").value) || undefined,
      temperature: Number($("chat-temperature").value),
    };
    const view = new AnswerView({ role: "assistant", state: "streaming" });
    log.append(view.node);
    setBusy(true);
    const turn = await streamAnswer(body, view, handles);
    handles.current = null;
    convo.turns.push(turn);
    save();
    render(); // the answer as stored; the previous one loses its Regenerate button
    setBusy(false);
    log.dataset.answered = String(Number(log.dataset.answered || 0) + 1); // answers ended
    const said = { done: "answer complete", cancelled: "answer stopped", error: "the answer failed" };
    const detail = turn.state === "error" ? turn.error : turn.meta;
    say(status, `${said[turn.state]}: ${detail}`, turn.state === "error" ? "error" : "info");
    input.focus();
  }

  async function submit() {
    const text = input.value.trim();
    if ((!text && !pending.length) || handles.current) return;
    convo.turns.push({ role: "user", text, media: pending });
    input.value = "";
    pending = [];
    renderTray();
    save();
    render();
    await ask();
  }

  function regenerate(i) {
    if (handles.current) return;
    convo.turns.splice(i);
    save();
    render();
    ask();
  }

  function edit(i) {
    if (handles.current) return;
    const turn = convo.turns[i];
    const editor = editorView(turn, {
      onSave(text) {
        if (!text && !(turn.media || []).length) return;
        convo.turns.splice(i, convo.turns.length - i, { ...turn, text });
        save();
        render();
        ask();
      },
      onCancel: render,
    });
    log.children[i].replaceWith(editor);
  }

  function renderTray() {
    tray.replaceChildren(
      ...pending.map((item, i) => {
        const label = `Remove ${item.name}`;
        const remove = el("button", { type: "button", className: "remove", "aria-label": label });
        remove.textContent = "×";
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
    const message = `${skipped} file(s) skipped: only images and videos`;
    say(status, skipped ? message : `${pending.length} attachment(s)`);
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
  $("chat-stop").addEventListener("click", async () => {
    if (!handles.current) return;
    $("chat-stop").disabled = true;
    try {
      await handles.current.cancel();
    } catch (error) {
      // a 404 means it had just ended
      if (error.status !== 404) say(status, `stop failed: ${error.message}`, "error");
    }
  });
  $("chat-files").addEventListener("change", (event) => {
    addFiles([...event.target.files]);
    event.target.value = "";
  });
  acceptFiles($("chat-drop"), input, addFiles);
  $("chat-new").addEventListener("click", () => {
    convo.clear();
    render();
    say(status, "new conversation");
  });
  system.value = convo.system;
  $("chat-system-box").open = Boolean(convo.system);
  system.addEventListener("input", () => {
    convo.system = system.value;
    save();
  });
  render();
  if (convo.turns.length) say(status, `${convo.turns.length} message(s) kept from before the reload`);
}
