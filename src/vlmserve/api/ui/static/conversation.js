// The chat's conversation: its turns and system prompt, kept in this tab's sessionStorage so
// that a reload keeps it (a new tab or a closed one starts empty). API keys are never part of
// it: they stay in api.js's memory.
//
// A turn is {role: "user", text, media: [{kind, name, mime, dataUrl, frames}]} or
// {role: "assistant", text, reasoning, meta, state, error, resumed}. sessionStorage holds a few
// MiB: when the attachments do not fit, they are kept as thumbnails only (their data is
// dropped, and the turn is sent again without them).

const KEY = "vlmserve-console-chat";

function stored() {
  try {
    return JSON.parse(sessionStorage.getItem(KEY) || "null");
  } catch {
    return null;
  }
}

function withoutMediaData(turns, keepFrames) {
  const strip = (m) => ({ ...m, dataUrl: null, frames: keepFrames ? m.frames : [] });
  return turns.map((t) => (t.media ? { ...t, media: t.media.map(strip) } : t));
}

export class Conversation {
  constructor() {
    const saved = stored();
    this.system = saved?.system ?? "";
    this.turns = Array.isArray(saved?.turns) ? saved.turns : [];
  }

  // Returns false when the attachments' data had to be left out to fit.
  save() {
    const turns = this.turns;
    const attempts = [turns, withoutMediaData(turns, true), withoutMediaData(turns, false)];
    for (const [i, kept] of attempts.entries()) {
      try {
        sessionStorage.setItem(KEY, JSON.stringify({ system: this.system, turns: kept }));
        return i === 0;
      } catch {
        // QuotaExceededError: try smaller
      }
    }
    return false;
  }

  clear() {
    this.turns = [];
    sessionStorage.removeItem(KEY);
  }

  // The API's messages for the turns before `end`: the system prompt first, and a question
  // whose answer failed before any token is left out with its answer (it is asked again).
  messages(end = this.turns.length) {
    const out = this.system.trim() ? [{ role: "system", content: this.system }] : [];
    const turns = this.turns.slice(0, end);
    turns.forEach((turn, i) => {
      const next = turns[i + 1];
      if (turn.role === "assistant") {
        if (turn.text) out.push({ role: "assistant", content: turn.text });
      } else if (!(next?.role === "assistant" && !next.text)) {
        out.push({ role: "user", content: userContent(turn) });
      }
    });
    return out;
  }
}

function userContent(turn) {
  const parts = (turn.media || [])
    .filter((m) => m.dataUrl)
    .map((m) =>
      m.kind === "image"
        ? { type: "image_url", image_url: { url: m.dataUrl } }
        : { type: "video_url", video_url: { url: m.dataUrl } },
    );
  if (!parts.length) return turn.text;
  return turn.text ? [...parts, { type: "text", text: turn.text }] : parts;
}
