// Server-sent events over fetch(): EventSource cannot POST or send an Authorization header.

const LINE = /\r\n|\r|\n/;

// Yields {id, event, data} for each event of a response body (a ReadableStream of bytes).
// Throws when the connection breaks mid-stream; returns when it ends cleanly.
export async function* readEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = { id: null, event: "message", data: [] };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      const lines = buffer.split(LINE);
      buffer = lines.pop(); // an unfinished line waits for the next chunk
      for (const line of lines) {
        if (line === "") {
          if (event.data.length) yield { ...event, data: event.data.join("\n") };
          event = { id: null, event: "message", data: [] };
          continue;
        }
        if (line.startsWith(":")) continue; // a comment (keep-alive)
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "data") event.data.push(value);
        else if (field === "id") event.id = value;
        else if (field === "event") event.event = value;
      }
    }
  } finally {
    reader.cancel().catch(() => {}); // closes the connection when the reader stops early
  }
}

// "<session_id>:<index>" -> index (a session id may itself hold colons: split on the last).
export function eventIndex(id) {
  const index = Number(id.slice(id.lastIndexOf(":") + 1));
  return Number.isInteger(index) ? index : null;
}
