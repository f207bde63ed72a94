// The server's public API, same origin only. Keys live in this module's memory: never in
// localStorage, cookies or the URL, so a reload forgets them.

const keys = { api: "", admin: "" };

export function setKey(kind, value) {
  keys[kind] = value.trim();
}

export function hasKey(kind) {
  return keys[kind] !== "";
}

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

function authHeaders(admin) {
  const key = admin ? keys.admin : keys.api || keys.admin; // an admin key opens /v1 too
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// Turn a non-2xx answer into an ApiError whose message says what to do.
export async function failure(response) {
  let body = null;
  let message = `${response.status} ${response.statusText}`;
  try {
    body = await response.json();
    message = body?.error?.message || body?.detail || message;
    if (Array.isArray(message)) message = message.map((d) => d.msg).join("; ");
  } catch {
    // not JSON: keep the status line
  }
  if (response.status === 401) message += " — enter the key under Keys";
  return new ApiError(response.status, message, body);
}

// fetch() with the key; `raw` returns the Response (streams), else its JSON.
// Options: method, json (a body to send as JSON), admin, headers, signal, raw.
export async function call(path, options = {}) {
  const { method = options.json === undefined ? "GET" : "POST", json, admin = false } = options;
  const headers = { ...authHeaders(admin), ...(options.headers || {}) };
  if (json !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method,
    headers,
    body: json === undefined ? undefined : JSON.stringify(json),
    signal: options.signal,
    cache: "no-store",
  });
  if (!response.ok) throw await failure(response);
  if (options.raw) return response;
  if (response.status === 204) return null;
  const type = response.headers.get("Content-Type") || "";
  return type.includes("json") ? response.json() : response.text();
}

export async function listModels() {
  const answer = await call("/v1/models");
  return answer.data;
}

// Which keys the server asks for ({api_key_required, admin_api, metrics_public}; no key in
// it), read once. A server too old to say is taken to ask for both.
let config = null;
export function serverConfig() {
  config ??= fetch("/ui/config.json", { cache: "no-store" })
    .then((r) => (r.ok ? r.json() : Promise.reject(new Error(r.statusText))))
    .catch(() => ({ api_key_required: true, admin_api: true, metrics_public: true }));
  return config;
}
