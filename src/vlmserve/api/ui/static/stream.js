// A chat completion streamed as a resumable session: POST once, and after a dropped
// connection GET /v1/streams/{session} with Last-Event-ID to replay what was missed and go on.

import { call } from "./api.js";
import { eventIndex, readEvents } from "./sse.js";

const MAX_RESUMES = 8;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

export class ChatStream {
  // handlers: onChunk(chunk), onError(error object), onResume(count)
  constructor(body, handlers) {
    this.body = { ...body, stream: true, stream_options: { include_usage: true, resumable: true } };
    this.handlers = handlers;
    this.sessionId = null;
    this.lastIndex = -1; // the index of the last event received
    this.resumes = 0;
    this.aborter = new AbortController();
  }

  // Resolves when the stream ended with [DONE] (or nothing was left to replay).
  async run() {
    const signal = this.aborter.signal;
    let response = await call("/v1/chat/completions", { json: this.body, raw: true, signal });
    this.sessionId = response.headers.get("X-Session-ID");
    let failures = 0; // drops in a row without a new event in between
    for (;;) {
      const before = this.lastIndex;
      try {
        if (await this.consume(response)) return;
      } catch (error) {
        if (signal.aborted) throw error;
      }
      // The connection dropped (an error, or an end without [DONE]): resume the session.
      if (!this.sessionId) throw new Error("the connection dropped before the stream started");
      if (this.lastIndex > before) failures = 0;
      for (;;) {
        if (++failures > MAX_RESUMES) throw new Error("the connection dropped; resuming failed");
        await sleep(Math.min(200 * 2 ** (failures - 1), 3000));
        try {
          response = await this.resume(signal);
          break;
        } catch (error) {
          if (signal.aborted || (error.status && error.status < 500)) throw error;
        }
      }
      this.resumes += 1;
      this.handlers.onResume?.(this.resumes);
      if (response.status === 204) return; // the end was already received
    }
  }

  resume(signal) {
    const headers = {};
    if (this.lastIndex >= 0) headers["Last-Event-ID"] = `${this.sessionId}:${this.lastIndex}`;
    const path = `/v1/streams/${encodeURIComponent(this.sessionId)}`;
    return call(path, { headers, raw: true, signal });
  }

  // True once [DONE] arrived; false when the body ended early.
  async consume(response) {
    for await (const event of readEvents(response.body)) {
      if (event.id !== null) {
        const index = eventIndex(event.id);
        this.sessionId ??= event.id.slice(0, event.id.lastIndexOf(":")); // if the header was lost
        if (index !== null) {
          if (index <= this.lastIndex) continue; // already shown (a replay overlap)
          this.lastIndex = index;
        }
      }
      if (event.data === "[DONE]") return true;
      let payload;
      try {
        payload = JSON.parse(event.data);
      } catch {
        continue;
      }
      if (event.event === "error" || payload.error)
        this.handlers.onError?.(payload.error || payload);
      else this.handlers.onChunk?.(payload);
    }
    return false;
  }

  // Stop generating: the server ends the stream with finish_reason "cancelled".
  async cancel() {
    if (!this.sessionId) {
      this.aborter.abort();
      return;
    }
    await call(`/v1/cancel/${encodeURIComponent(this.sessionId)}`, { method: "POST" });
  }
}
