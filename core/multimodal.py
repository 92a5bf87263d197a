"""Images, videos and audio in prompts: what a request carries, from the client to the runner (plain data), and
the two seams a multimodal family implements.

A prompt holds one placeholder token per image (the chat template renders it from an image content part; a raw prompt
writes it). The family's :class:`ImageProcessor` turns each image into its processed tensors and the tokens that
replace its placeholder; :func:`expand_prompt` splices them in, so each image becomes a :class:`MultiModalItem`, a
span of the prompt whose rows (``embed_rows``: all of them, or those of the placeholder token) take the image's
embeddings instead of their tokens'. The request carries its items to every rank of the target (``NewRequest.
multimodal``); a rank's :class:`ImageEncoder` (vision tower and projector, replicated on every tensor-parallel rank
of the first pipeline stage) embeds an item when a step first reaches its span, and the runner hands the rows to the
model through ``AttentionMetadata.input_embeds`` (the text model's embedding step overwrites them). A span may be
split over prefill chunks: its embeddings are kept until the prefill passes it. Prefix caching keys an image's first
token by the item's content hash, so two prompts share cached blocks only up to the first image they differ in.

Videos and audio take the same path: a processor that takes them says so (``video_token_id`` /
``process_video``, ``audio_token_id`` / ``sampling_rate`` / ``process_audio``), and its encoder tells an item's kind
by the tensors it gets.

A family with multimodal RoPE (Qwen2-VL) gives the prompt's three position ids per token
(:meth:`ImageProcessor.rope_positions`); the tokens past the prompt take their slot index plus ``rope_delta`` on
every axis.

Families register ``(encoder class, processor class)`` per architecture in :mod:`specray.models.registry`
(``multimodal_classes``).
"""

from __future__ import annotations

import base64
import bisect
import binascii
import hashlib
import io
import json
import os
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from specray.sampling_params import is_int

IMAGE, VIDEO, AUDIO = "image", "video", "audio"
TEXT_ONLY = ("this model reads text only (of a multimodal release, its text model, or its encoders turned off by "
             "limit_mm_per_prompt): send the prompt without images, videos or audio")
# what a prompt dict may hold under ``multi_modal_data`` (vLLM's key); each a single item or a list
MODALITIES = (IMAGE, VIDEO, AUDIO)
PLURAL = {IMAGE: "images", VIDEO: "videos", AUDIO: "audio"}
MAX_VIDEO_FRAMES = 1024  # the most frames a video may hold (a longer one is refused: sample it first)
MAX_AUDIO_SECONDS = 3600  # the longest audio a prompt may hold (a longer one is refused: cut it first)


@dataclass
class MultiModalItem:
    """One image (or video) of a prompt: the prompt's span ``[offset, offset + length)`` that replaced its
    placeholder, the rows of that span taking its embeddings (``embed_rows``, ascending indices within the span;
    None: every row), its content hash and the processor's tensors for the encoder (numpy arrays: they cross Ray as
    plain data)."""

    modality: str
    offset: int
    length: int
    hash: str
    data: dict[str, np.ndarray]
    embed_rows: list[int] | None = None
    # its tokens attend to each other both ways (Gemma 3's images): its span is never split over prefill chunks
    bidirectional: bool = False

    def __post_init__(self):
        rows = self.embed_rows
        assert rows is None or all(a < b for a, b in zip([-1] + rows, rows + [self.length])), rows  # ascending

    @property
    def num_embeds(self) -> int:
        return self.length if self.embed_rows is None else len(self.embed_rows)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class MultiModalInputs:
    """A request's images in prompt order, and for a family with multimodal RoPE the prompt's position ids
    (``rope_positions``: three lists, one per axis, each as long as the prompt) and what the tokens past it add to
    their slot index (``rope_delta``)."""

    items: list[MultiModalItem]
    rope_positions: list[list[int]] | None = None
    rope_delta: int = 0

    def rope_columns(self, positions: Sequence[int]) -> list[list[int]]:
        """Multimodal RoPE's three position ids (one list per axis) of tokens at ``positions``: a prompt token's
        are its table's column, a later one's its position plus ``rope_delta`` on every axis."""
        table = self.rope_positions
        n = 0 if table is None else len(table[0])
        return [[table[axis][p] if p < n else p + self.rope_delta for p in positions] for axis in range(3)]

    def cache_keys(self, token_ids: Sequence[int]) -> list:
        """``token_ids`` (the prompt first) with each image's first token replaced by its content hash: the keys
        prefix caching registers blocks under (a block's key chains its parent's, so one key per image suffices)."""
        keyed = list(token_ids)
        for item in self.items:
            keyed[item.offset] = ("image", item.hash)
        return keyed


@dataclass
class ProcessedImage:
    """What an :class:`ImageProcessor` makes of one image: the tokens that replace its placeholder, which of them
    take its embeddings (None: all), and its tensors for the encoder."""

    replacement: list[int]
    data: dict[str, np.ndarray]
    embed_rows: list[int] | None = None
    bidirectional: bool = False  # the replacement's tokens attend to each other both ways (Gemma 3)


class ImageProcessor(Protocol):
    """A vision-language family's host side (built once per engine from the checkpoint's folder)."""

    image_token_id: int | None  # the placeholder a prompt holds once per image (None: a family without images)

    def process(self, image: Any) -> ProcessedImage:
        """One PIL image -> its replacement tokens and tensors (as transformers' processor makes them)."""
        ...

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> tuple[list[list[int]], int] | None:
        """Multimodal RoPE: the expanded prompt's three position ids per token and the delta of later tokens;
        None for a family with plain positions."""
        ...

    # optional: ``finish_prompt(token_ids, items) -> (token_ids, items)``, the expanded prompt as transformers'
    # processor makes it where splicing tokens cannot (Gemma 3: its image text's newlines join their neighbours'
    # into one token), items moved with it

    # optional, a family that takes videos: ``video_token_id`` (the placeholder a prompt holds once per video) and
    # ``process_video(frames: list[PIL image]) -> ProcessedImage`` (its tokens and tensors, as transformers' video
    # processor and processor make them); ``rope_positions`` then gets its items too (``item.modality == "video"``);
    # the engine sets ``num_frames`` on it where ``media_io_kwargs`` names one (:func:`video_frames`)

    # optional, a family that takes audio: ``audio_token_id`` (the placeholder a prompt holds once per audio),
    # ``sampling_rate`` (the rate its waveforms are resampled to) and ``process_audio(waveform: float32 [samples],
    # mono) -> ProcessedImage`` (as transformers' feature extractor and processor make them); and
    # ``max_audio_samples``, the longest audio one placeholder takes (samples at ``sampling_rate``; a longer one is
    # refused by ``process_audio``), where the family has such a bound: the OpenAI server's transcriptions cut a
    # longer file into clips of at most that many (:func:`audio_clips`)


class ImageEncoder(Protocol):
    """A vision-language family's device side: an ``nn.Module`` built from the whole checkpoint's config."""

    # DeepStack (Qwen3-VL): how many of the text model's first layers add an image's own features after them (0:
    # none); ``encode`` then returns [1 + deepstack_layers, num_embeds, H], the input embeddings first
    deepstack_layers: int

    # optional: a classmethod ``check_split(whole_config, tensor_parallel_size, pipeline_parallel_size)`` refusing
    # (ValueError) a split of the model its images cannot be served over, checked before any rank starts

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The whole checkpoint's tensors; it reads its own (vision tower, projector) and ignores the rest."""
        ...

    def encode(self, data: dict[str, Any]) -> Any:
        """One item's tensors (on the encoder's device) -> its embeddings [num_embeds, text hidden size], or for an
        image made of discrete codes (a VQ tokenizer's, Chameleon-style) its token ids [num_embeds] (int64), which
        the text model embeds as the prompt's own tokens (as do the drafters reading images)."""
        ...


MAX_IMAGE_BYTES = 32 << 20  # an image fetched or decoded from a URL (a larger one is refused)
MAX_VIDEO_BYTES = 256 << 20  # a video file's
MAX_AUDIO_BYTES = 64 << 20  # an audio file's
VIDEO_FRAMES = 32  # the frames taken from a video file, evenly spaced (vLLM's default num_frames)
FETCH_TIMEOUT_S = 10.0  # an http(s) image's download


def load_image(source: Any, local: bool = True, domains: Collection[str] | None = None):
    """A PIL image (RGB) from what a caller may hand in: a PIL image, encoded bytes, a ``data:`` URL (base64), an
    http(s) URL (with ``domains``, one on those hosts only, redirects included; vLLM's ``--allowed-media-domains``),
    or (``local``: offline callers, never a server's clients) a local path to an image file."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        image = source
    else:
        data = media_bytes(source, IMAGE, local, domains)
        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
            raise ValueError(f"the image could not be decoded ({err}); send a PNG, JPEG, WebP or GIF image") from None
    if image.width == 0 or image.height == 0:
        raise ValueError(f"the image is {image.width}x{image.height} pixels, empty: send an image of at least one "
                         "pixel each way")
    return image.convert("RGB")


def media_bytes(source: Any, kind: str = IMAGE, local: bool = True, domains: Collection[str] | None = None) -> bytes:
    """An image's or a video's file bytes: given as bytes, a ``data:`` URL (base64), an http(s) URL (with
    ``domains``, one on those hosts only) or (``local``) a local path; at most the kind's byte limit."""
    limit = _byte_limit(kind)
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    elif isinstance(source, str) and source.startswith("data:"):
        data = decode_data_url(source, kind)
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        data = fetch_url(source, domains, kind)
    elif local and isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        if not path.is_file():
            raise ValueError(f"{kind} {str(source)!r:.100} is not a file; give {kind} bytes, a data: URL, an http(s) "
                             f"URL or the path of {kind} file")
        data = path.read_bytes()
    else:
        what = f"{source!r:.60}" if isinstance(source, str) else f"of type {type(source).__name__}"
        given = {IMAGE: ", a PIL image, image bytes or a file path",
                 VIDEO: ", a list of frames, an array [T, H, W, 3], video bytes or a file path",
                 AUDIO: ", a (waveform, sampling_rate) pair, audio file bytes or a file path"}[kind]
        raise ValueError(f"{kind} {what} is not supported; give a data: URL (data:{kind}/...;base64,...) or an "
                         f"http(s) URL{given if local else ''}")
    if len(data) > limit:
        raise ValueError(f"the {kind} has {len(data)} bytes, more than {limit}; send a smaller {kind}")
    return data


def _byte_limit(kind: str) -> int:
    return {IMAGE: MAX_IMAGE_BYTES, VIDEO: MAX_VIDEO_BYTES, AUDIO: MAX_AUDIO_BYTES}[kind]


def fetch_url(url: str, domains: Collection[str] | None = None, kind: str = IMAGE) -> bytes:
    """An http(s) image's (or video's) bytes (at most the kind's byte limit, within :data:`FETCH_TIMEOUT_S`), from
    one of ``domains``' hosts where given (a redirect elsewhere refused)."""
    import urllib.error
    import urllib.parse
    import urllib.request

    def check(target: str) -> None:
        host = urllib.parse.urlsplit(target).hostname
        if domains is not None and host not in domains:
            raise ValueError(f"the {kind} URL's host {host!r} is not among this server's allowed media domains "
                             f"({sorted(domains)}); send the {kind} as a data: URL")

    class Redirects(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            check(newurl)
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    limit = _byte_limit(kind)
    check(url)
    try:
        with urllib.request.build_opener(Redirects).open(url, timeout=FETCH_TIMEOUT_S) as response:
            data = response.read(limit + 1)
    except (urllib.error.URLError, OSError) as err:
        raise ValueError(f"the {kind} at {url!r:.100} could not be fetched ({err}); check the URL, or send the {kind} "
                         "as a data: URL") from None
    if len(data) > limit:
        raise ValueError(f"the {kind} at {url!r:.100} has more than {limit} bytes; send a smaller {kind}")
    return data


def decode_data_url(url: str, kind: str = IMAGE) -> bytes:
    """The bytes of a ``data:[<type>][;base64],<data>`` URL (base64) of a ``kind`` (image, video, audio)."""
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ValueError(f"data URL {url[:40]!r}... must be 'data:{kind}/<type>;base64,<data>'")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"data URL {url[:40]!r}... holds invalid base64 ({err})") from None


def media_of(multi_modal_data: Any) -> dict[str, list]:
    """The images, videos and audios of a prompt's ``multi_modal_data`` ({"image": an image or a list of them,
    "video": a video or a list of them, "audio": an audio or a list of them}), each kind in order. A video is a list
    of frames or an array [T, H, W, 3]: a list of such lists (or arrays) is several videos. An audio is a
    ``(waveform, sampling_rate)`` pair (vLLM's form) or a waveform: a list of them is several audios."""
    if not isinstance(multi_modal_data, dict):
        raise ValueError(f"multi_modal_data={multi_modal_data!r:.80} must be a dict such as {{'image': image}}")
    unknown = sorted(set(multi_modal_data) - set(MODALITIES))
    if unknown:
        raise ValueError(f"multi_modal_data holds {unknown}: only {list(MODALITIES)} are supported")
    images = multi_modal_data.get(IMAGE, [])
    videos = multi_modal_data.get(VIDEO, [])
    audios = multi_modal_data.get(AUDIO, [])
    one_video = isinstance(videos, np.ndarray) or (isinstance(videos, (list, tuple)) and bool(videos)
                                                   and not _is_video(videos[0]))
    one_audio = _is_audio_pair(audios) or not isinstance(audios, (list, tuple))
    return {IMAGE: list(images) if isinstance(images, (list, tuple)) else [images],
            VIDEO: [videos] if one_video else list(videos) if isinstance(videos, (list, tuple)) else [videos],
            AUDIO: [audios] if one_audio else list(audios)}


def _is_audio_pair(value: Any) -> bool:
    """vLLM's ``(waveform, sampling_rate)`` form of one audio (rather than a list of two audios)."""
    return (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[1], (int, float, np.number))
            and not isinstance(value[1], bool))


def _is_video(value: Any) -> bool:
    """A video (a list of frames, an array [T, H, W, 3], a video file's bytes, URL or path) rather than one frame
    (a PIL image or an array [H, W, 3])."""
    return (isinstance(value, (list, tuple, bytes, bytearray, str, os.PathLike))
            or (isinstance(value, np.ndarray) and value.ndim == 4))


def images_of(multi_modal_data: Any) -> list:
    """The images of a prompt's ``multi_modal_data``, in order (:func:`media_of`)."""
    return media_of(multi_modal_data)[IMAGE]


class VideoFrames(list):
    """A video's frames (RGB PIL images), and ``fps``: how many of them a second of the video holds (a file's
    frames as taken from it; None for frames given as they are, whose times are not known)."""

    fps: float | None = None


def load_video(video: Any, local: bool = True, domains: Collection[str] | None = None,
               num_frames: int = VIDEO_FRAMES) -> VideoFrames:
    """A video's frames as RGB PIL images, in order: from a list of frames (each what :func:`load_image` takes) or
    an array [T, H, W, 3] of uint8 (vLLM's form), the frames as given; or from a video file (bytes, a ``data:`` URL,
    an http(s) URL, a path: :func:`media_bytes`), ``num_frames`` frames evenly spaced over it (all of a shorter
    one)."""
    from PIL import Image

    fps = getattr(video, "fps", None)  # (frames loaded before keep their rate)
    if isinstance(video, (bytes, bytearray, str, os.PathLike)):
        frames = decode_video(media_bytes(video, VIDEO, local, domains), num_frames)
        fps = frames.fps
    elif isinstance(video, np.ndarray):
        if video.ndim != 4 or video.shape[-1] != 3 or video.dtype != np.uint8:
            raise ValueError(f"a video array must be [frames, height, width, 3] of uint8, not {video.dtype} "
                             f"{list(video.shape)}")
        frames = [Image.fromarray(frame) for frame in video]
    elif isinstance(video, (list, tuple)):
        frames = [Image.fromarray(frame) if isinstance(frame, np.ndarray) and frame.dtype == np.uint8
                  else load_image(frame, local, domains) for frame in video]
    else:
        raise ValueError(f"a video of type {type(video).__name__} is not supported: give a list of frames (PIL "
                         "images, image bytes, data: URLs, ...) or an array [frames, height, width, 3] of uint8")
    frames = VideoFrames(frame.convert("RGB") for frame in frames)
    frames.fps = fps
    if not 0 < len(frames) <= MAX_VIDEO_FRAMES:
        raise ValueError(f"a video of {len(frames)} frames: give 1 to {MAX_VIDEO_FRAMES} (sample a longer one)")
    if len({frame.size for frame in frames}) > 1:
        raise ValueError(f"a video's frames must share one size, not {sorted({frame.size for frame in frames})}")
    return frames


def frame_stack(frames: list) -> np.ndarray:
    """A video's RGB frames of one size (PIL images) -> [frames, height, width, 3] uint8, for a video processor."""
    if not frames:
        raise ValueError("a video must hold at least one frame")
    arrays = [np.asarray(frame.convert("RGB"), dtype=np.uint8) for frame in frames]
    if any(a.shape != arrays[0].shape for a in arrays):
        raise ValueError(f"a video's frames must share one size; got {sorted({a.shape[:2] for a in arrays})}")
    return np.stack(arrays)


def load_audio(audio: Any, sampling_rate: int, local: bool = True, domains: Collection[str] | None = None
               ) -> np.ndarray:
    """An audio's waveform (float32 [samples], mono: channels averaged) at ``sampling_rate``: from vLLM's
    ``(waveform, rate)`` pair (resampled where its rate differs), a 1-D float array (taken to be at
    ``sampling_rate``, as vLLM takes one), or an audio file (bytes, a ``data:`` URL, an http(s) URL, a path:
    :func:`media_bytes`) decoded by FFmpeg."""
    if isinstance(audio, (bytes, bytearray, str, os.PathLike)):
        wave = decode_audio(media_bytes(audio, AUDIO, local, domains), sampling_rate)
    elif _is_audio_pair(audio) or isinstance(audio, np.ndarray):
        wave, rate = audio if _is_audio_pair(audio) else (audio, sampling_rate)
        wave = np.asarray(wave)
        if wave.dtype.kind not in "fiu" or wave.ndim not in (1, 2) or wave.size == 0:
            raise ValueError(f"an audio waveform must be a non-empty array of numbers [samples] (or [samples, "
                             f"channels]), not {wave.dtype} {list(wave.shape)}")
        if not rate > 0:
            raise ValueError(f"an audio's sampling rate must be positive, not {rate}: give (waveform, rate in Hz)")
        if wave.ndim == 2:  # channels on the shorter axis (soundfile's [samples, channels], librosa's transpose)
            wave = wave.mean(axis=int(wave.shape[0] > wave.shape[1]))
        wave = wave.astype(np.float32) / (np.iinfo(wave.dtype).max + 1 if wave.dtype.kind in "iu" else 1)
        if rate != sampling_rate:
            wave = resample(wave, float(rate), sampling_rate)
    else:
        raise ValueError(f"an audio of type {type(audio).__name__} is not supported: give a (waveform, "
                         "sampling_rate) pair, a waveform array at the model's rate, or an audio file (bytes, "
                         "a data: URL, an http(s) URL or a path)")
    if not np.isfinite(wave).all():
        raise ValueError("an audio waveform holds NaN or infinite samples; send finite ones")
    if not 0 < len(wave) <= MAX_AUDIO_SECONDS * sampling_rate:
        raise ValueError(f"an audio of {len(wave) / sampling_rate:.1f} s: give one of up to {MAX_AUDIO_SECONDS} s "
                         "(cut a longer one)")
    return np.ascontiguousarray(wave, dtype=np.float32)


CLIP_SEARCH_SECONDS = 1.0  # a clip of a long audio ends at the quietest point of its last second ...
CLIP_WINDOW_SECONDS = 0.1  # ... found by the mean square of windows this long


def audio_clips(wave: np.ndarray, most: int, rate: int) -> list[np.ndarray]:
    """A mono waveform cut into consecutive clips of at most ``most`` samples, for a model that takes no longer
    audio (vLLM's speech-to-text chunking): a clip that cannot hold the rest ends in the middle of the quietest
    window (the least mean square over ``CLIP_WINDOW_SECONDS``; the last of equals) of its last
    ``CLIP_SEARCH_SECONDS``, so that a cut falls between words where the audio allows it. The clips are views of
    ``wave`` whose concatenation is ``wave``; one clip (``wave`` itself) when it fits."""
    assert most >= 2, most
    search = max(2, min(int(CLIP_SEARCH_SECONDS * rate), most // 2))  # the span before a clip's end searched
    width = max(1, min(int(CLIP_WINDOW_SECONDS * rate), search // 2))  # the windows compared within it
    clips, start = [], 0
    while wave.shape[0] - start > most:
        lo = start + most - search  # windows [w, w + width) within [lo, start + most)
        sums = np.concatenate(([0.0], np.cumsum(np.square(wave[lo : start + most], dtype=np.float64))))
        energy = sums[width:] - sums[:-width]  # of the window starting at lo + i
        w = lo + energy.shape[0] - 1 - int(np.argmin(energy[::-1]))  # the last of the quietest: clips long
        cut = w + width // 2 + 1  # just past the window's middle (a clip never longer than ``most``)
        clips.append(wave[start:cut])
        start = cut
    clips.append(wave[start:])
    return clips


def resample(wave: np.ndarray, rate: float, to_rate: int) -> np.ndarray:
    """A mono float32 waveform at ``rate`` resampled to ``to_rate`` (FFmpeg's resampler)."""
    import av

    if rate * 1000 < to_rate or to_rate * 1000 < rate or rate != int(rate):
        raise ValueError(f"an audio at {rate} Hz cannot be resampled to {to_rate} Hz; give a whole rate in Hz")
    frame = av.AudioFrame.from_ndarray(wave[None, :], format="flt", layout="mono")
    frame.sample_rate = int(rate)
    return _resampled([frame], to_rate)


def _resampled(frames: Iterable, to_rate: int) -> np.ndarray:
    """Audio frames resampled to float32 at ``to_rate``, the resampler flushed at the end, and made mono by the
    channels' mean (as librosa makes it; FFmpeg's own downmix scales the sum by another factor)."""
    import av

    resampler = av.AudioResampler(format="fltp", rate=to_rate)  # the frames' own channels kept, planar
    out = [o.to_ndarray() for frame in [*frames, None] for o in resampler.resample(frame)]
    return np.concatenate(out, axis=1).mean(axis=0, dtype=np.float32) if out else np.zeros(0, np.float32)


def decode_audio(data: bytes, sampling_rate: int) -> np.ndarray:
    """An audio file's first audio stream (WAV, MP3, FLAC, Ogg, ... or a video's sound), mono float32 at
    ``sampling_rate``."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.audio:
                raise ValueError("no audio stream")
            wave = _resampled(container.decode(audio=0), sampling_rate)
    except (av.FFmpegError, ValueError) as err:
        raise ValueError(f"the audio could not be decoded ({err}); send a WAV, MP3, FLAC, Ogg or other file FFmpeg "
                         "reads, with an audio stream") from None
    if not len(wave):
        raise ValueError("the audio holds no samples; send one that does")
    return wave


def item_hash(modality: str, data: dict[str, np.ndarray]) -> str:
    """A content hash of an item's processed tensors (names, dtypes, shapes and bytes)."""
    digest = hashlib.sha256(modality.encode())
    for name in sorted(data):
        array = np.ascontiguousarray(data[name])
        digest.update(f"|{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def decode_video(data: bytes, num_frames: int = VIDEO_FRAMES) -> VideoFrames:
    """A video file's frames (RGB PIL images): ``num_frames`` of them evenly spaced from the first to the last (all
    where it has fewer), with how many of them a second holds (from their timestamps, else the stream's rate);
    frames not taken are decoded but never converted."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:  # (an audio file: else IndexError's "tuple index out of range")
                kinds = sorted({stream.type for stream in container.streams})
                raise ValueError(f"the file holds no video stream, only {' and '.join(kinds) or 'nothing'}")
            total = container.streams.video[0].frames
        if not total:  # a container that does not say: count them
            with av.open(io.BytesIO(data)) as container:
                total = sum(1 for _ in container.decode(video=0))
        wanted = set(np.linspace(0, total - 1, min(num_frames, total)).round().astype(int).tolist()) if total else set()
        with av.open(io.BytesIO(data)) as container:
            rate = container.streams.video[0].average_rate
            taken = [(frame.time, frame.to_image()) for i, frame in enumerate(container.decode(video=0))
                     if i in wanted]
        frames = VideoFrames(image for _, image in taken)
        times = [t for t, _ in taken if t is not None]
        span = times[-1] - times[0] if len(times) == len(taken) > 1 else 0.0
        if span > 0:
            frames.fps = (len(times) - 1) / span
        elif rate:  # one frame, or no timestamps: the stream's rate, thinned as the frames were
            frames.fps = float(rate) * len(frames) / max(total, 1)
    except (av.FFmpegError, IndexError, ValueError) as err:
        raise ValueError(f"the video could not be decoded ({err or 'no video stream'}); send an MP4, WebM or other "
                         "file FFmpeg reads, with a video stream") from None
    if not frames:
        raise ValueError("the video holds no frames; send one that does")
    return frames


def expand_prompt(token_ids: list[int], images: list, processor: ImageProcessor, videos: Sequence = (),
                  audios: Sequence = ()) -> tuple[list[int], MultiModalInputs]:
    """The prompt with each image's placeholder (and each video's, each audio's) replaced by its tokens, and the
    request's items (in the order of their placeholders). A ValueError when a kind's placeholders and items differ
    in number, or for a kind the processor takes none of."""
    given = {IMAGE: list(images), VIDEO: list(videos), AUDIO: list(audios)}
    token_of = {kind: getattr(processor, f"{kind}_token_id", None) for kind in MODALITIES}
    takes = [kind for kind in MODALITIES if token_of[kind] is not None]
    for kind in MODALITIES:
        if given[kind] and token_of[kind] is None:
            raise ValueError(f"this model's processor takes no {PLURAL[kind]} (only "
                             f"{' and '.join(PLURAL[k] for k in takes)}): send the prompt without {PLURAL[kind]}")
    slots = check_placeholders(token_ids, processor, {kind: len(items) for kind, items in given.items()})
    out: list[int] = []
    items: list[MultiModalItem] = []
    last = 0
    for slot, kind in slots:
        item = given[kind].pop(0)
        done = (processor.process(load_image(item)) if kind == IMAGE else
                processor.process_video(load_video(item, num_frames=video_frames(processor))) if kind == VIDEO else
                processor.process_audio(load_audio(item, processor.sampling_rate)))
        out.extend(token_ids[last:slot])
        items.append(MultiModalItem(kind, len(out), len(done.replacement), item_hash(kind, done.data), done.data,
                                    done.embed_rows, done.bidirectional))
        out.extend(done.replacement)
        last = slot + 1
    out.extend(token_ids[last:])
    finish = getattr(processor, "finish_prompt", None)
    if finish is not None:
        out, items = finish(out, items)
    mm = MultiModalInputs(items)
    rope = processor.rope_positions(out, items)
    if rope is not None:
        mm.rope_positions, mm.rope_delta = rope
    return out, mm


def placeholder_ids(config) -> set[int]:
    """The token ids a release's config (or a processor) names as its media placeholders or their openings
    (``image_token_id``, ``image_token_index``, the video's and audio's alike; Gemma 3's ``boi_token_index``, the
    placeholder its chat template writes)."""
    ids = (getattr(config, f"{kind}_token_{suffix}", None) for kind in (*MODALITIES, "boi", "boa")
           for suffix in ("id", "index"))
    return {i for i in ids if is_int(i)}


def check_placeholders(token_ids: Sequence[int], processor: ImageProcessor, counts: dict[str, int] | None = None
                       ) -> list[tuple[int, str]]:
    """The prompt's placeholders (index, kind), in order; a ValueError unless each kind's number of them is the
    number of its items the request gave (``counts``, kind -> number; None: a prompt sent without any)."""
    token_of = {kind: getattr(processor, f"{kind}_token_id", None) for kind in MODALITIES}
    takes = [kind for kind in MODALITIES if token_of[kind] is not None]
    kind_of = {token_of[kind]: kind for kind in takes}
    # (a prompt without any, the usual text prompt, is looked through once in C)
    slots = [] if kind_of.keys().isdisjoint(token_ids) else [
        (i, kind_of[t]) for i, t in enumerate(token_ids) if t in kind_of]
    for kind in takes:
        held, given = sum(k == kind for _, k in slots), (counts or {}).get(kind, 0)
        if held != given:
            raise ValueError(f"the prompt holds {held} {kind} placeholder token(s) (id {token_of[kind]}) but "
                             f"{given} {kind}(s) were given: put one placeholder per {kind} in the prompt (the chat "
                             f"template writes one per {kind} content part), or send the {PLURAL[kind]} in "
                             "multi_modal_data")
    return slots


MEDIA_IO_KEYS = {VIDEO: ("num_frames",)}  # what media_io_kwargs may set, per kind


def check_media_io_kwargs(kwargs: Any) -> None:
    """``media_io_kwargs`` (vLLM's): None, or how media files are read, per kind: ``{"video": {"num_frames": N}}``
    takes N frames, evenly spaced, from each video file (:data:`VIDEO_FRAMES` by default; 1 to
    :data:`MAX_VIDEO_FRAMES`)."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(kind in MEDIA_IO_KEYS and isinstance(v, dict) and set(v) <= set(
            MEDIA_IO_KEYS[kind]) for kind, v in kwargs.items()):
        raise ValueError(f"media_io_kwargs={kwargs!r:.100} must map a kind to its settings, of "
                         f"{ {k: list(v) for k, v in MEDIA_IO_KEYS.items()} }, e.g. {{'video': {{'num_frames': 16}}}}")
    frames = kwargs.get(VIDEO, {}).get("num_frames", VIDEO_FRAMES)
    if isinstance(frames, bool) or not isinstance(frames, int) or not 0 < frames <= MAX_VIDEO_FRAMES:
        raise ValueError(f"media_io_kwargs video num_frames={frames!r} must be an int from 1 to {MAX_VIDEO_FRAMES} "
                         "(the frames taken from each video file)")


def video_frames(processor: Any) -> int:
    """The frames taken from each video file for ``processor``'s model: its ``num_frames``, set from the engine's
    ``media_io_kwargs`` (:func:`specray.models.loader.engine_image_processor`), else :data:`VIDEO_FRAMES`."""
    return getattr(processor, "num_frames", None) or VIDEO_FRAMES


def check_mm_limits(limits: Any) -> None:
    """``limit_mm_per_prompt`` (vLLM's): None, or a dict of a modality to the most items a prompt may hold."""
    if limits is None:
        return
    if (not isinstance(limits, dict) or set(limits) - set(MODALITIES)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in limits.values())):
        raise ValueError(f"limit_mm_per_prompt={limits!r:.80} must map {list(MODALITIES)} to the most items a prompt "
                         "may hold, e.g. {'image': 4} ({'image': 0}: text only)")


def text_only(limits: dict[str, int] | None) -> bool:
    """``limit_mm_per_prompt`` turns a multimodal release's encoders off: every kind it names is limited to 0
    (``{'image': 0}``); the release then serves its text model alone."""
    return bool(limits) and not any(limits.values())


def check_mm_counts(multimodal: MultiModalInputs, limits: dict[str, int | None]) -> None:
    """A ValueError where the prompt holds more of a kind than ``limits`` (kind -> the most; None: any) allows."""
    for kind, most in limits.items():
        held = sum(item.modality == kind for item in multimodal.items)
        if most is not None and held > most:
            if not most:
                raise ValueError(TEXT_ONLY if kind == IMAGE else f"this engine takes no {PLURAL[kind]} (a text "
                                 f"model, or limit_mm_per_prompt={{'{kind}': 0}}): send the prompt without "
                                 f"{PLURAL[kind]}")
            raise ValueError(f"the prompt holds {held} {kind} items; this engine takes at most {most} per prompt "
                             f"(limit_mm_per_prompt): send fewer, or raise the limit")


def check_image_prompt(multimodal: MultiModalInputs, token_ids: list[int], truncate_prompt_tokens: int | None
                       ) -> None:
    """A ValueError unless ``multimodal`` fits the prompt ``token_ids`` it was made with, which is not to be cut."""
    if truncate_prompt_tokens is not None:
        raise ValueError("truncate_prompt_tokens cannot cut a prompt with images, videos or audio: it could cut "
                         "their tokens; leave it unset")
    n = len(token_ids)
    spans = [(item.offset, item.end) for item in multimodal.items]
    if not spans or any(not 0 <= a < b <= n for a, b in spans) or any(b > c for (_, b), (c, _) in
                                                                     zip(spans, spans[1:])):
        raise ValueError(f"multimodal: the spans {spans} of its images, videos or audio must be non-empty, in order "
                         f"and within the prompt's {n} tokens (as specray.multimodal.expand_prompt makes them)")
    rope = multimodal.rope_positions
    if rope is not None and (len(rope) != 3 or any(len(axis) != n for axis in rope)):
        raise ValueError(f"multimodal.rope_positions must hold three lists of the prompt's length {n}")


def rope_ids(inputs: Sequence[MultiModalInputs | None], positions: Sequence[Sequence[int]]
             ) -> tuple[list[list[int]], int]:
    """Multimodal RoPE's position ids (three lists) of rows of several requests (``inputs[i]``: request i's, None
    without images; ``positions[i]``: its rows' positions, in order), and the largest."""
    axes: list[list[int]] = [[], [], []]
    for mm, own in zip(inputs, positions):
        for axis, ids in zip(axes, [list(own)] * 3 if mm is None else mm.rope_columns(own)):
            axis.extend(ids)
    return axes, max(max(axis) for axis in axes)


def read_json(path: Path) -> dict:
    """A JSON file's object ({} where there is no such file)."""
    return json.loads(Path(path).read_text()) if Path(path).is_file() else {}


def image_processor_settings(folder: Any) -> dict:
    """A checkpoint folder's image processor settings: ``preprocessor_config.json``, else the ``image_processor``
    entry of ``processor_config.json`` (what transformers 5 writes); {} where neither holds them."""
    folder = Path(folder)
    return read_json(folder / "preprocessor_config.json") or read_json(folder / "processor_config.json").get(
        "image_processor") or {}


def special_token_ids(tokenizer: Any, tokens: Sequence[str | None], folder: Any, writer: str) -> list[int]:
    """The ids of ``tokens`` in the folder's ``tokenizer``; a ValueError naming one it lacks (None: a token the
    tokenizer does not name), which ``writer`` (the release's processor) writes for an image."""
    ids = []
    for token in tokens:
        found = None if token is None else tokenizer.convert_tokens_to_ids(token)
        if found is None or found == getattr(tokenizer, "unk_token_id", None):
            raise ValueError(f"the tokenizer of {folder} has no {token!r} token, which {writer} writes for an image; "
                             "use the release's tokenizer")
        ids.append(int(found))
    return ids


def step_rows(item: MultiModalItem, start: int, stop: int) -> tuple[list[int], list[int]]:
    """The prompt positions in ``[start, stop)`` that take ``item``'s embeddings, and those embeddings' indices (an
    item's rows ascend: found by bisection, not by a walk over a long video's)."""
    rows = range(item.length) if item.embed_rows is None else item.embed_rows
    a, b = bisect.bisect_left(rows, start - item.offset), bisect.bisect_left(rows, stop - item.offset)
    return [item.offset + row for row in rows[a:b]], list(range(a, b))
