// The console's entry point: tabs, keys, and the model lists the pages pick from.

import { hasKey, listModels, serverConfig, setKey } from "./api.js";
import { setupChat } from "./chat.js";
import { say } from "./dom.js";
import { setupExtract } from "./extract.js";
import { setupModels } from "./models.js";
import { setupSearch } from "./search.js";

const $ = (id) => document.getElementById(id);
const PAGES = ["chat", "search", "extract", "models"];

let models = null;

function fillSelect(select, names, { blank = null, prefer = null } = {}) {
  const before = select.value;
  const options = names.map((m) => new Option(m.ready ? m.id : `${m.id} (not ready)`, m.id));
  if (blank) options.unshift(new Option(blank, ""));
  select.replaceChildren(...options);
  const keep = [before, prefer].find((v) => v && [...select.options].some((o) => o.value === v));
  if (keep) select.value = keep;
}

const has = (m, role) => (m.roles || []).includes(role);

async function loadModels() {
  const status = $("global-status");
  try {
    const list = await listModels();
    const chat = list.filter((m) => !has(m, "embedding") || has(m, "chat"));
    const embed = list.filter((m) => has(m, "embedding"));
    fillSelect($("chat-model"), chat.length ? chat : list);
    fillSelect($("search-model"), embed.length ? embed : list);
    fillSelect($("extract-model"), chat.length ? chat : list, {
      blank: "server default (role extract, else chat)",
    });
    say(status, `${list.length} model(s)`);
    document.body.dataset.models = "loaded";
  } catch (error) {
    const message =
      error.status === 401
        ? "This server needs an API key: type it under Keys, then press Use keys."
        : error.message;
    say(status, message, "error");
    document.body.dataset.models = "error";
  }
}

// Tabs: a tablist with arrow keys, Home and End; the URL's #fragment names the page.
function setupTabs() {
  const tabs = PAGES.map((p) => $(`tab-${p}`));
  function select(page, focus = false) {
    if (!PAGES.includes(page)) page = "chat";
    for (const p of PAGES) {
      const on = p === page;
      const tab = $(`tab-${p}`);
      tab.setAttribute("aria-selected", String(on));
      tab.tabIndex = on ? 0 : -1;
      $(`page-${p}`).hidden = !on;
    }
    if (focus) $(`tab-${page}`).focus();
    if (location.hash !== `#${page}`) history.replaceState(null, "", `#${page}`);
    models.visible(page === "models");
  }
  tabs.forEach((tab, i) => {
    tab.addEventListener("click", () => select(PAGES[i]));
    tab.addEventListener("keydown", (event) => {
      const moves = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: PAGES.length - 1 };
      if (!(event.key in moves)) return;
      event.preventDefault();
      select(PAGES[(moves[event.key] + PAGES.length) % PAGES.length], true);
    });
  });
  window.addEventListener("hashchange", () => select(location.hash.slice(1)));
  select(location.hash.slice(1));
}

// What the Keys box says: whether this server asks for keys at all. It starts folded where no
// key is needed, or on a phone once a key is set: the page comes first.
async function showKeyNeeds() {
  const { api_key_required: api, admin_api: admin } = await serverConfig();
  const need = api
    ? "this server needs an API key"
    : admin
      ? "none needed for the API; an admin key opens the Models controls"
      : "none needed: this server has no keys";
  $("keys-need").textContent = hasKey("api") || hasKey("admin") ? "(set)" : `(${need})`;
  $("admin-key").disabled = !admin;
  $("admin-key").title = admin ? "" : "this server has no admin API (it starts with --admin-key)";
  const phone = matchMedia("(max-width: 640px)").matches;
  $("keys-box").open = api && !(phone && hasKey("api"));
}

// Keys are read as typed and kept in memory; "Use keys" reloads what depends on them.
function setupKeys() {
  for (const kind of ["api", "admin"]) {
    $(`${kind}-key`).addEventListener("input", (event) => setKey(kind, event.target.value));
  }
  $("keys-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setKey("api", $("api-key").value);
    setKey("admin", $("admin-key").value);
    say($("keys-status"), "keys set (kept in this page's memory only)");
    showKeyNeeds();
    loadModels();
    if (!$("page-models").hidden) models.refresh();
  });
}

models = setupModels({ onChange: loadModels });
setupKeys();
setupChat();
setupSearch();
setupExtract();
setupTabs();
showKeyNeeds();
loadModels();
