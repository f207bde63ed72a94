// Files the user gives (picker, drop, paste) -> data URLs for the API, and thumbnails:
// an image as itself, a video as a few frames drawn from a <video> onto a canvas.

const FRAME_WIDTH = 160;

export function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function once(target, name) {
  return new Promise((resolve, reject) => {
    target.addEventListener(name, resolve, { once: true });
    target.addEventListener("error", () => reject(new Error("the browser cannot decode it")), {
      once: true,
    });
  });
}

// JPEG data URLs of `count` frames spread over the video (empty if the browser cannot play it).
export function videoFrames(file, count = 3, width = FRAME_WIDTH) {
  const timeout = new Promise((resolve) => setTimeout(() => resolve([]), 8000));
  return Promise.race([drawFrames(file, count, width), timeout]);
}

async function drawFrames(file, count, width) {
  const url = URL.createObjectURL(file);
  const video = document.createElement("video");
  video.muted = true;
  video.preload = "auto";
  video.playsInline = true;
  try {
    video.src = url;
    await once(video, "loadeddata");
    const duration = Number.isFinite(video.duration) ? video.duration : 0;
    const height = Math.max(1, Math.round((width * video.videoHeight) / video.videoWidth || width));
    const canvas = document.createElement("canvas");
    canvas.width = width;
    canvas.height = height;
    const context = canvas.getContext("2d");
    const frames = [];
    for (let i = 0; i < count; i += 1) {
      const time = (duration * (i + 0.5)) / count;
      if (Math.abs(video.currentTime - time) > 1e-3) {
        const seeked = once(video, "seeked");
        video.currentTime = time;
        await seeked;
      }
      context.drawImage(video, 0, 0, width, height);
      frames.push(canvas.toDataURL("image/jpeg", 0.8));
    }
    return frames;
  } catch {
    return [];
  } finally {
    video.removeAttribute("src");
    video.load();
    URL.revokeObjectURL(url);
  }
}

// {kind, name, mime, dataUrl, frames} for an image or video file; null for anything else.
export async function loadMedia(file) {
  const kind = file.type.startsWith("image/")
    ? "image"
    : file.type.startsWith("video/")
      ? "video"
      : null;
  if (!kind) return null;
  const dataUrl = await readDataUrl(file);
  const frames = kind === "video" ? await videoFrames(file) : [dataUrl];
  return { kind, name: file.name || `pasted ${kind}`, mime: file.type, dataUrl, frames };
}

// The OpenAI content part that carries one item.
export function contentPart(item) {
  return item.kind === "image"
    ? { type: "image_url", image_url: { url: item.dataUrl } }
    : { type: "video_url", video_url: { url: item.dataUrl } };
}

// A thumbnail: the image, or the video's frames side by side (or a label if none decoded).
export function thumbnail(item) {
  const figure = document.createElement("figure");
  figure.className = `thumb thumb-${item.kind}`;
  const strip = document.createElement("div");
  strip.className = "frames";
  for (const frame of item.frames) {
    const img = document.createElement("img");
    img.src = frame;
    img.alt = "";
    strip.append(img);
  }
  if (!item.frames.length) strip.textContent = "▶";
  const caption = document.createElement("figcaption");
  caption.textContent = item.name;
  figure.append(strip, caption);
  figure.setAttribute("aria-label", `${item.kind} ${item.name}`);
  return figure;
}

// Wire a drop zone: files dropped on `zone` (and pasted into `pasteTarget`) go to `onFiles`.
export function acceptFiles(zone, pasteTarget, onFiles) {
  zone.addEventListener("dragover", (event) => {
    event.preventDefault();
    zone.classList.add("dragging");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("dragging"));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.classList.remove("dragging");
    onFiles([...event.dataTransfer.files]);
  });
  pasteTarget?.addEventListener("paste", (event) => {
    const files = [...(event.clipboardData?.files || [])];
    if (files.length) {
      event.preventDefault();
      onFiles(files);
    }
  });
}
