// Models page: each model's state, memory, in-flight requests, keep-alive and last use
// (GET /admin/state, admin key), activate / deactivate, live tokens/s and TTFT (/metrics), and
// charts of the last 15 minutes of readings (timeline.js, charts.js).

import { call, hasKey, listModels, serverConfig } from "./api.js";
import { LiveCharts } from "./charts.js";
import { el, fmtAgo, fmtBytes, fmtSeconds, say, table } from "./dom.js";
import { mediaQueue, parseMetrics, perModel, rates } from "./metrics.js";
import { Timeline } from "./timeline.js";

const $ = (id) => document.getElementById(id);
const POLL_MS = 2000;

function patchCell(cell, fresh) {
  const buttons = cell.querySelectorAll("button");
  if (buttons.length) {
    fresh.querySelectorAll("button").forEach((b, k) => (buttons[k].disabled = b.disabled));
  } else if (!cell.isEqualNode(fresh)) {
    cell.replaceChildren(...fresh.childNodes);
  }
}

export function setupModels({ onChange }) {
  const status = $("models-status");
  const holder = $("models-table");
  const updated = $("models-updated");
  let reading = null; // {at, numbers}: the last /metrics reading
  let live = {};
  let timer = null;
  const timeline = new Timeline();
  const charts = new LiveCharts($("models-charts-grid"));
  const chartStatus = $("models-charts-status");

  async function readMetrics() {
    try {
      const samples = parseMetrics(await call("/metrics"));
      const numbers = perModel(samples);
      const at = performance.now();
      live = rates(reading?.numbers, numbers, reading ? (at - reading.at) / 1000 : 0);
      reading = { at, numbers };
      timeline.add(numbers, mediaQueue(samples));
      charts.draw(timeline.charts());
      say(chartStatus, timeline.models().length ? "" : "no chat model has reported yet");
    } catch (error) {
      live = {}; // /metrics may be closed to this key: the table still shows the rest
      say(chartStatus, `no charts: /metrics answered ${error.message}`, "error");
    }
  }

  function actions(name, state) {
    const busy = state === "loading" || state === "unloading" || state === "draining";
    const activate = el(
      "button",
      { type: "button", disabled: busy || state === "ready" },
      "Activate",
    );
    const deactivate = el(
      "button",
      { type: "button", disabled: busy || state !== "ready" },
      "Deactivate",
    );
    activate.setAttribute("aria-label", `Activate ${name}`);
    deactivate.setAttribute("aria-label", `Deactivate ${name}`);
    activate.addEventListener("click", () => act("activate", name));
    deactivate.addEventListener("click", () => act("deactivate", name));
    return el("span", { className: "actions" }, activate, deactivate);
  }

  function speed(name) {
    const r = live[name];
    if (!r) return "—";
    const ttft = r.recentTtft ?? r.meanTtft;
    const first = ttft === null ? "—" : fmtSeconds(ttft);
    return `${r.tokensPerSecond.toFixed(1)} tok/s · TTFT ${first}`;
  }

  function adminTable(models) {
    const rows = models.map((m) => ({
      row: { dataset: { model: m.name, state: m.state } },
      cells: [
        m.name,
        el("span", { className: `state state-${m.state}` }, m.state),
        fmtBytes(m.memory_bytes),
        String(m.in_flight),
        fmtSeconds(m.keep_alive),
        fmtAgo(m.last_used),
        speed(m.name),
        actions(m.name, m.state),
      ],
    }));
    const headers = [
      "Model",
      "State",
      "Memory",
      "In flight",
      "Keep-alive",
      "Last use",
      "Live",
      "Actions",
    ];
    return table("Models (admin view)", headers, rows, "models");
  }

  function publicTable(models, adminApi) {
    const rows = models.map((m) => ({
      row: { dataset: { model: m.id, state: m.ready ? "ready" : "not-ready" } },
      cells: [m.id, m.ready ? "ready" : "not ready", (m.roles || []).join(", "), speed(m.id)],
    }));
    const caption = adminApi
      ? "Models (enter an admin key for state and controls)"
      : "Models (this server has no admin API: no controls)";
    return table(caption, ["Model", "State", "Roles", "Live"], rows, "models");
  }

  // Update the table in place when the same models are listed (a button under the pointer
  // or the keyboard focus stays where it is); rebuild it otherwise.
  function show(wrap) {
    const rows = (root) => [...root.querySelectorAll("tbody tr")];
    const old = rows(holder);
    const fresh = rows(wrap);
    const same =
      holder.querySelector("caption")?.textContent === wrap.querySelector("caption").textContent &&
      old.length === fresh.length &&
      old.every((row, i) => row.dataset.model === fresh[i].dataset.model);
    if (!same) return holder.replaceChildren(wrap);
    old.forEach((row, i) => {
      Object.assign(row.dataset, fresh[i].dataset);
      const cells = [...fresh[i].cells];
      [...row.cells].forEach((cell, j) => patchCell(cell, cells[j]));
    });
  }

  async function refresh() {
    await readMetrics();
    try {
      if (status.dataset.kind === "error") say(status, "");
      if (hasKey("admin")) {
        const answer = await call("/admin/state", { admin: true });
        show(adminTable(answer.models));
        const time = new Date().toLocaleTimeString();
        const { models, streams } = answer;
        const counts = `${models.length} model(s), ${streams.active} active stream(s)`;
        updated.textContent = `${counts} · ${time}`;
      } else {
        const { admin_api: adminApi } = await serverConfig();
        show(publicTable(await listModels(), adminApi));
        updated.textContent = adminApi
          ? "An admin key (under Keys) shows memory, keep-alive and controls."
          : "Start the server with --admin-key (or VLMSERVE_ADMIN_KEYS) for memory, " +
            "keep-alive and controls.";
      }
    } catch (error) {
      say(status, error.message, "error");
    }
  }

  async function act(verb, name) {
    say(status, `${verb === "activate" ? "activating" : "deactivating"} ${name}…`);
    for (const button of holder.querySelectorAll("button")) button.disabled = true;
    try {
      await call(`/admin/${verb}`, { json: { model: name }, admin: true });
      say(status, `${name} ${verb}d`);
      onChange?.();
    } catch (error) {
      say(status, `${verb} ${name} failed: ${error.message}`, "error");
    }
    await refresh();
  }

  // Poll only while the page is shown and the tab is visible.
  function visible(shown) {
    clearInterval(timer);
    timer = null;
    if (shown) {
      refresh();
      timer = setInterval(() => {
        if (!document.hidden && $("models-auto").checked) refresh();
      }, POLL_MS);
    }
  }

  $("models-refresh").addEventListener("click", refresh);
  return { visible, refresh };
}
