// A small reader of Prometheus' text format: enough for vlmserve's counters and histograms.

const SAMPLE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

// [{name, labels, value}] of every sample line.
export function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = SAMPLE.exec(line);
    if (!match) continue;
    const labels = {};
    for (const [, key, value] of (match[2] || "").matchAll(LABEL)) {
      labels[key] = value.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    samples.push({ name: match[1], labels, value: Number(match[3]) });
  }
  return samples;
}

const BY_NAME = {
  vlmserve_num_requests_running: "running",
  vlmserve_num_requests_waiting: "waiting",
  vlmserve_kv_cache_usage_ratio: "kvUsage",
  vlmserve_kv_cache_bytes: "kvBytes",
};
const TTFT = "vlmserve_time_to_first_token_seconds";

// {model: {tokens, ttftSum, ttftCount, ttftBuckets: {le: count}, running, waiting, kvUsage,
// kvBytes}}
// from vlmserve's generation and engine series (a gauge a model does not export is undefined).
export function perModel(samples) {
  const out = {};
  const get = (model) =>
    (out[model] ??= { tokens: 0, ttftSum: 0, ttftCount: 0, ttftBuckets: {} });
  for (const { name, labels, value } of samples) {
    const model = labels.model ?? "";
    if (name === "vlmserve_output_tokens_total") get(model).tokens += value;
    else if (name === `${TTFT}_sum`) get(model).ttftSum += value;
    else if (name === `${TTFT}_count`) get(model).ttftCount += value;
    else if (name === `${TTFT}_bucket`) {
      const buckets = get(model).ttftBuckets;
      buckets[labels.le] = (buckets[labels.le] ?? 0) + value;
    } else if (name in BY_NAME) get(model)[BY_NAME[name]] = value;
  }
  return out;
}

// Requests waiting in the media pipeline (decode and preprocessing), summed over its gauges
// (vlmserve_media_*queue*, *waiting*, *in_flight*); null where the server exports none.
export function mediaQueue(samples) {
  const gauges = samples.filter((s) => /^vlmserve_media_\w*(queue|waiting|in_flight)/.test(s.name));
  return gauges.length ? gauges.reduce((sum, s) => sum + s.value, 0) : null;
}

// Prometheus' histogram_quantile: the q-quantile of the observations counted by cumulative
// `buckets` ({le: count}), interpolated linearly inside its bucket; null with no observation.
export function quantile(q, buckets) {
  const sorted = Object.entries(buckets)
    .map(([le, count]) => [le === "+Inf" ? Infinity : Number(le), count])
    .sort((a, b) => a[0] - b[0]);
  const total = sorted.length ? sorted[sorted.length - 1][1] : 0;
  if (!(total > 0)) return null;
  const rank = q * total;
  let [lower, below] = [0, 0];
  for (const [le, count] of sorted) {
    if (count >= rank) {
      if (le === Infinity) return lower; // above the highest bound: its bound, as Prometheus
      return count === below ? le : lower + ((le - lower) * (rank - below)) / (count - below);
    }
    [lower, below] = [le, count];
  }
  return lower;
}

// The counts observed between two readings of the same cumulative buckets.
export function bucketDelta(before, after) {
  const out = {};
  for (const [le, count] of Object.entries(after)) out[le] = Math.max(0, count - (before?.[le] ?? 0));
  return out;
}

// Rates between two readings taken `seconds` apart: tokens/s, and the TTFT of the requests
// that started in between (else the average since start).
export function rates(before, after, seconds) {
  const out = {};
  for (const [model, now] of Object.entries(after)) {
    const then = before?.[model] ?? now;
    const newFirsts = now.ttftCount - then.ttftCount;
    out[model] = {
      tokensPerSecond: seconds > 0 ? Math.max(0, now.tokens - then.tokens) / seconds : 0,
      recentTtft: newFirsts > 0 ? (now.ttftSum - then.ttftSum) / newFirsts : null,
      meanTtft: now.ttftCount > 0 ? now.ttftSum / now.ttftCount : null,
      tokens: now.tokens,
    };
  }
  return out;
}
