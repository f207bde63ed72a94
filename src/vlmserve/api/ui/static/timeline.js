// The last 15 minutes of /metrics readings, and the charts' series drawn from them: output
// tokens/s, TTFT p50 and p90 over the last minute, requests running and waiting, KV cache
// usage, and the media queue where the server exports one. One series per model.

import { bucketDelta, quantile } from "./metrics.js";

export const WINDOW_MS = 15 * 60 * 1000;
const TTFT_WINDOW_MS = 60 * 1000;
const GAP_MS = 10 * 1000; // readings further apart than this: no rate drawn across them

export class Timeline {
  constructor() {
    this.readings = []; // {t: ms since the epoch, models: perModel(...), media: number|null}
  }

  add(models, media, t = Date.now()) {
    this.readings.push({ t, models, media });
    while (this.readings.length && this.readings[0].t < t - WINDOW_MS) this.readings.shift();
  }

  // Models that generate: a KV cache, or tokens or a first token counted (an embedding model
  // reports its load gauges too, at zero).
  models() {
    const last = this.readings[this.readings.length - 1];
    if (!last) return [];
    return Object.entries(last.models)
      .filter(([, m]) => m.kvBytes > 0 || m.tokens > 0 || m.ttftCount > 0)
      .map(([name]) => name)
      .sort();
  }

  // [{key, title, x: [unix seconds], lines: [{label, values}]}] for the charts.
  charts() {
    const x = this.readings.map((r) => r.t / 1000);
    const models = this.models();
    const each = (fn, suffix = "") =>
      models.map((m) => ({ label: `${m}${suffix}`, values: this.readings.map((r, i) => fn(m, r, i)) }));
    const gauge = (field, scale = 1) => (m, r) => {
      const value = r.models[m]?.[field];
      return value === undefined ? null : value * scale;
    };
    const charts = [
      { key: "tokens", title: "Output tokens/s", lines: each((m, r, i) => this.rate(m, i)) },
      {
        key: "ttft",
        title: "TTFT p50 / p90, s (last minute)",
        floor: 0.01,
        lines: [...each(this.ttft(0.5), " p50"), ...each(this.ttft(0.9), " p90")],
      },
      {
        key: "load",
        title: "Requests running / waiting",
        lines: [...each(gauge("running"), " running"), ...each(gauge("waiting"), " waiting")],
      },
      { key: "kv", title: "KV cache usage, %", lines: each(gauge("kvUsage", 100)) },
    ];
    if (this.readings.some((r) => r.media !== null)) {
      const values = this.readings.map((r) => r.media);
      charts.push({ key: "media", title: "Media queue", lines: [{ label: "media", values }] });
    }
    return charts.map((chart) => ({ ...chart, x }));
  }

  rate(model, i) {
    const [before, now] = [this.readings[i - 1], this.readings[i]];
    if (!before || now.t - before.t > GAP_MS || !before.models[model]) return null;
    const tokens = (now.models[model]?.tokens ?? 0) - before.models[model].tokens;
    return Math.max(0, tokens) / ((now.t - before.t) / 1000);
  }

  // The q-quantile of the TTFTs observed in the minute up to each reading.
  ttft(q) {
    return (model, now) => {
      const start = this.readings.find((r) => r.t >= now.t - TTFT_WINDOW_MS);
      const [then, at] = [start?.models[model]?.ttftBuckets, now.models[model]?.ttftBuckets];
      return start === now || !at ? null : quantile(q, bucketDelta(then, at));
    };
  }
}
