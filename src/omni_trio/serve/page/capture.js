// The microphone's AudioWorklet: the input's first channel, resampled (linearly) from
// the context's rate to 24 kHz, as 16-bit PCM posted in chunks of `chunk` samples.
// The page sends each chunk as one input_audio_buffer.append.

const RATE = 24000;

class Capture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.step = sampleRate / RATE; // input samples per output sample
    this.pos = 0; // where the next output sample falls, relative to this block's start
    this.prev = 0; // the last sample of the block before (at position -1)
    this.size = options.processorOptions.chunk;
    this.chunk = new Int16Array(this.size);
    this.filled = 0;
  }

  process(inputs) {
    const input = inputs[0] && inputs[0][0];
    if (!input || input.length === 0) return true;
    const last = input.length - 1;
    while (this.pos < last) {
      const i = Math.floor(this.pos);
      const frac = this.pos - i;
      const a = i < 0 ? this.prev : input[i];
      const b = input[i + 1];
      const v = Math.max(-1, Math.min(1, a + (b - a) * frac));
      this.chunk[this.filled++] = v < 0 ? v * 0x8000 : v * 0x7fff;
      if (this.filled === this.size) {
        this.port.postMessage(this.chunk.buffer, [this.chunk.buffer]);
        this.chunk = new Int16Array(this.size); // the one posted was handed over
        this.filled = 0;
      }
      this.pos += this.step;
    }
    this.pos -= input.length;
    this.prev = input[last];
    return true;
  }
}

registerProcessor("omni-capture", Capture);
