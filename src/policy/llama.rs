//! A thin, owned wrapper over the parts of llama.cpp's C API the engine uses.
//!
//! `llama-cpp-2`'s safe types do not expose the context's evaluation callback, which is the
//! cheap way to read the final normalised hidden state (`result_norm`) of exactly the rows that
//! produce logits. So the engine talks to `llama-cpp-sys-2` directly through this module; all
//! `unsafe` of the policy lives here, each block next to the invariant that makes it sound.
//! These objects are `Send` but not `Sync`: one thread (the engine) owns them.

use std::ffi::{c_char, c_void, CStr, CString};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::OnceLock;

use llama_cpp_sys_2 as sys;

use crate::error::{Error, Result};

/// A token id, as llama.cpp defines it.
pub type Token = i32;

static BACKEND: OnceLock<()> = OnceLock::new();

/// Initialises the llama.cpp backend once per process and routes its logs into `tracing`
/// (`verbose = false` silences them; they are ~2,300 lines per model load).
pub fn init_backend(verbose: bool) {
    BACKEND.get_or_init(|| {
        llama_cpp_2::send_logs_to_tracing(
            llama_cpp_2::LogOptions::default().with_logs_enabled(verbose),
        );
        // SAFETY: called once per process, guarded by the OnceLock.
        unsafe { sys::llama_backend_init() };
    });
}

/// A loaded GGUF model and its vocabulary.
pub struct Model {
    ptr: NonNull<sys::llama_model>,
    vocab: NonNull<sys::llama_vocab>,
}

// SAFETY: the model is only used from the thread that owns the `Model` value.
unsafe impl Send for Model {}

impl Model {
    /// Loads a GGUF model on the CPU (`n_gpu_layers` > 0 offloads layers when llama.cpp was built
    /// with a GPU backend).
    ///
    /// # Errors
    /// [`Error::BadModel`] when llama.cpp cannot load the file.
    pub fn load(path: &Path, n_gpu_layers: i32) -> Result<Self> {
        let cpath =
            CString::new(path.to_string_lossy().as_bytes()).map_err(|_| Error::BadModel {
                path: path.into(),
                reason: "path contains a NUL byte".into(),
            })?;
        // SAFETY: default params are plain data; the path is a valid C string for the call.
        let ptr = unsafe {
            let mut params = sys::llama_model_default_params();
            params.n_gpu_layers = n_gpu_layers;
            sys::llama_model_load_from_file(cpath.as_ptr(), params)
        };
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::BadModel {
            path: path.into(),
            reason: "llama.cpp could not load it (run with -v to see llama.cpp's log)".into(),
        })?;
        // SAFETY: ptr is a live model; the vocab lives as long as the model.
        let vocab = unsafe { sys::llama_model_get_vocab(ptr.as_ptr()) };
        let vocab = NonNull::new(vocab as *mut _).ok_or_else(|| Error::BadModel {
            path: path.into(),
            reason: "model has no vocabulary".into(),
        })?;
        Ok(Model { ptr, vocab })
    }

    /// Vocabulary size.
    pub fn n_vocab(&self) -> usize {
        // SAFETY: vocab is live while self is.
        unsafe { sys::llama_vocab_n_tokens(self.vocab.as_ptr()) as usize }
    }

    /// Width of the hidden state.
    pub fn n_embd(&self) -> usize {
        // SAFETY: model is live.
        unsafe { sys::llama_model_n_embd(self.ptr.as_ptr()) as usize }
    }

    /// Context length the model was trained with.
    pub fn n_ctx_train(&self) -> usize {
        // SAFETY: model is live.
        unsafe { sys::llama_model_n_ctx_train(self.ptr.as_ptr()) as usize }
    }

    /// Whether tokenising a fresh prompt should add BOS.
    pub fn add_bos(&self) -> bool {
        // SAFETY: vocab is live.
        unsafe { sys::llama_vocab_get_add_bos(self.vocab.as_ptr()) }
    }

    /// True for end-of-generation tokens (EOS, EOT, …).
    pub fn is_eog(&self, token: Token) -> bool {
        // SAFETY: vocab is live; any token id is accepted.
        unsafe { sys::llama_vocab_is_eog(self.vocab.as_ptr(), token) }
    }

    /// True for control tokens (`<|im_start|>` and the like): template markup, never text.
    pub fn is_control(&self, token: Token) -> bool {
        // SAFETY: vocab is live; any token id is accepted.
        let attr = unsafe { sys::llama_vocab_get_attr(self.vocab.as_ptr(), token) };
        (attr as u32) & sys::LLAMA_TOKEN_ATTR_CONTROL != 0
    }

    /// The end-of-turn token, falling back to EOS.
    pub fn eot(&self) -> Option<Token> {
        // SAFETY: vocab is live.
        let (eot, eos) = unsafe {
            (
                sys::llama_vocab_eot(self.vocab.as_ptr()),
                sys::llama_vocab_eos(self.vocab.as_ptr()),
            )
        };
        [eot, eos].into_iter().find(|&t| t >= 0)
    }

    /// The chat template stored in the GGUF metadata, if any.
    pub fn chat_template(&self) -> Option<String> {
        // SAFETY: model is live; a null name asks for the default template; the returned string
        // is owned by the model.
        unsafe {
            let p = sys::llama_model_chat_template(self.ptr.as_ptr(), std::ptr::null());
            if p.is_null() {
                None
            } else {
                Some(CStr::from_ptr(p).to_string_lossy().into_owned())
            }
        }
    }

    /// A string metadata value.
    pub fn meta(&self, key: &str) -> Option<String> {
        let ckey = CString::new(key).ok()?;
        let mut buf = vec![0u8; 256];
        // SAFETY: buf is writable for its length; the key is a valid C string.
        let n = unsafe {
            sys::llama_model_meta_val_str(
                self.ptr.as_ptr(),
                ckey.as_ptr(),
                buf.as_mut_ptr() as *mut c_char,
                buf.len(),
            )
        };
        if n < 0 {
            return None;
        }
        let n = (n as usize).min(buf.len() - 1);
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    }

    /// Tokenises text. `parse_special` makes control tokens such as `<|im_start|>` single tokens
    /// (wanted for template text, not for user content).
    ///
    /// # Errors
    /// [`Error::Llama`] when llama.cpp reports a failure.
    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>> {
        let len = i32::try_from(text.len()).map_err(|_| Error::Invalid("text too long".into()))?;
        let mut out = vec![0 as Token; text.len() + 8];
        for _ in 0..2 {
            // SAFETY: text is valid for len bytes; out is writable for out.len() tokens.
            let n = unsafe {
                sys::llama_tokenize(
                    self.vocab.as_ptr(),
                    text.as_ptr() as *const c_char,
                    len,
                    out.as_mut_ptr(),
                    out.len() as i32,
                    add_special,
                    parse_special,
                )
            };
            if n >= 0 {
                out.truncate(n as usize);
                return Ok(out);
            }
            if n == i32::MIN {
                return Err(Error::Llama("tokenization overflow".into()));
            }
            out.resize((-n) as usize, 0);
        }
        Err(Error::Llama("tokenization failed".into()))
    }

    /// The bytes of one token (control tokens rendered when `special`).
    pub fn piece(&self, token: Token, special: bool) -> Vec<u8> {
        let mut buf = vec![0u8; 64];
        loop {
            // SAFETY: buf is writable for its length.
            let n = unsafe {
                sys::llama_token_to_piece(
                    self.vocab.as_ptr(),
                    token,
                    buf.as_mut_ptr() as *mut c_char,
                    buf.len() as i32,
                    0,
                    special,
                )
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return buf;
            }
            buf.resize((-n) as usize, 0);
        }
    }

    /// Renders a conversation with a chat template (llama.cpp's built-in template engine, which
    /// recognises the common formats by their markers).
    ///
    /// # Errors
    /// [`Error::Template`] when the template is not recognised or a message holds a NUL byte.
    pub fn apply_template(
        template: &str,
        messages: &[(&str, &str)],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = CString::new(template).map_err(|_| Error::Template("NUL in template".into()))?;
        let owned: Vec<(CString, CString)> = messages
            .iter()
            .map(|(r, c)| Ok((CString::new(*r)?, CString::new(*c)?)))
            .collect::<std::result::Result<_, std::ffi::NulError>>()
            .map_err(|_| Error::Template("a message contains a NUL byte".into()))?;
        let chat: Vec<sys::llama_chat_message> = owned
            .iter()
            .map(|(r, c)| sys::llama_chat_message {
                role: r.as_ptr(),
                content: c.as_ptr(),
            })
            .collect();
        let total: usize = messages.iter().map(|(r, c)| r.len() + c.len()).sum();
        let mut buf = vec![0u8; 2 * total + 256];
        for _ in 0..2 {
            // SAFETY: chat points at `owned`, alive for the call; buf is writable for its length.
            let n = unsafe {
                sys::llama_chat_apply_template(
                    tmpl.as_ptr(),
                    chat.as_ptr(),
                    chat.len(),
                    add_generation_prompt,
                    buf.as_mut_ptr() as *mut c_char,
                    buf.len() as i32,
                )
            };
            if n < 0 {
                return Err(Error::Template(
                    "llama.cpp does not recognise this model's chat template; pass --template chatml (or another built-in name)".into(),
                ));
            }
            let n = n as usize;
            if n <= buf.len() {
                buf.truncate(n);
                return String::from_utf8(buf)
                    .map_err(|_| Error::Template("rendered text is not UTF-8".into()));
            }
            buf.resize(n, 0);
        }
        Err(Error::Template("template output kept growing".into()))
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: the pointer came from llama_model_load_from_file and is freed once; contexts
        // borrow the model only through `Context`, which the engine drops first.
        unsafe { sys::llama_model_free(self.ptr.as_ptr()) };
    }
}

/// A GGUF LoRA adapter loaded by llama.cpp for a model (freed on drop; the model must outlive
/// it).
pub struct LoraAdapter {
    ptr: NonNull<sys::llama_adapter_lora>,
}

// SAFETY: used only from the thread that owns the model and contexts.
unsafe impl Send for LoraAdapter {}

impl LoraAdapter {
    /// Loads a GGUF LoRA for `model` with llama.cpp's own loader.
    ///
    /// # Errors
    /// [`Error::BadModel`] when llama.cpp refuses the file (wrong architecture, shapes, type).
    pub fn load(model: &Model, path: &Path) -> Result<Self> {
        let bad = |reason: &str| Error::BadModel {
            path: path.into(),
            reason: reason.into(),
        };
        let cpath = CString::new(path.to_string_lossy().as_bytes())
            .map_err(|_| bad("path contains a NUL byte"))?;
        // SAFETY: model is live; the path is a valid C string for the call.
        let ptr = unsafe { sys::llama_adapter_lora_init(model.ptr.as_ptr(), cpath.as_ptr()) };
        NonNull::new(ptr)
            .map(|ptr| LoraAdapter { ptr })
            .ok_or_else(|| bad("llama.cpp could not load this LoRA for the model"))
    }
}

impl Drop for LoraAdapter {
    fn drop(&mut self) {
        // SAFETY: allocated by llama_adapter_lora_init and freed once; contexts that used it
        // have had it removed (`Context::set_lora(None)`) or are dropped first by the owner.
        unsafe { sys::llama_adapter_lora_free(self.ptr.as_ptr()) };
    }
}

/// Hidden states captured by the evaluation callback during one `decode`.
struct Capture {
    enabled: bool,
    n_embd: usize,
    rows: Vec<f32>,
    /// `l_out-N` to capture for every row (block LoRA's input), NUL-terminated name
    block: Option<Vec<u8>>,
    block_rows: Vec<f32>,
}

const RESULT_NORM: &[u8] = b"result_norm";

/// llama.cpp's scheduler asks this for every graph node (`ask = true`: "do you want its data?")
/// and then hands over the ones we asked for after they are computed. We ask only for
/// `result_norm`, the final normalised hidden state of the rows that produce logits.
unsafe extern "C" fn eval_callback(t: *mut sys::ggml_tensor, ask: bool, user: *mut c_void) -> bool {
    // SAFETY: llama.cpp passes a live tensor; `user` is the Box<Capture> owned by the Context,
    // which outlives every decode call on it.
    unsafe {
        let cap = &mut *(user as *mut Capture);
        let name = CStr::from_ptr((*t).name.as_ptr());
        let block = cap.block.as_deref() == Some(name.to_bytes());
        let wanted = cap.enabled && name.to_bytes() == RESULT_NORM;
        if ask {
            return wanted || block;
        }
        if block && (*t).type_ == sys::GGML_TYPE_F32 && (*t).ne[0] as usize == cap.n_embd {
            let n = (*t).ne[0] as usize * (*t).ne[1] as usize;
            let start = cap.block_rows.len();
            cap.block_rows.resize(start + n, 0.0);
            sys::ggml_backend_tensor_get(
                t,
                cap.block_rows[start..].as_mut_ptr() as *mut c_void,
                0,
                n * std::mem::size_of::<f32>(),
            );
        }
        if wanted && (*t).type_ == sys::GGML_TYPE_F32 {
            let ne0 = (*t).ne[0] as usize;
            let ne1 = (*t).ne[1] as usize;
            if ne0 == cap.n_embd {
                let start = cap.rows.len();
                cap.rows.resize(start + ne0 * ne1, 0.0);
                sys::ggml_backend_tensor_get(
                    t,
                    cap.rows[start..].as_mut_ptr() as *mut c_void,
                    0,
                    ne0 * ne1 * std::mem::size_of::<f32>(),
                );
            }
        }
        true
    }
}

/// Settings for a llama.cpp context.
#[derive(Debug, Clone, Copy)]
pub struct ContextParams {
    /// context window in tokens
    pub n_ctx: u32,
    /// largest batch decoded at once
    pub n_batch: u32,
    /// CPU threads (llama.cpp's numbers depend on it, so it is fixed per engine)
    pub n_threads: i32,
    /// capture `result_norm` for every output row
    pub capture_hidden: bool,
    /// capture `l_out-N` (the output of block N) for every row, and run attention without
    /// flash attention (whose f16 accumulation the block-LoRA graph does not reproduce)
    pub capture_block: Option<usize>,
    /// sequences the context holds at once (each up to `n_ctx` tokens; the KV cache is one
    /// unified buffer, so a prefix copied between sequences shares its cells)
    pub n_seq: u32,
    /// cells of that buffer (`None`: `n_ctx × n_seq`)
    pub kv_cells: Option<u32>,
}

/// One row of a batch: `token` of sequence `seq` at position `pos`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    /// the token
    pub token: Token,
    /// its position in its sequence
    pub pos: usize,
    /// the sequence (`0..n_seq`)
    pub seq: usize,
    /// whether logits (and the captured hidden state) of this row are wanted
    pub output: bool,
}

/// A llama.cpp context with `n_seq` sequences and a reusable batch.
pub struct Context {
    ptr: NonNull<sys::llama_context>,
    batch: sys::llama_batch,
    capture: Box<Capture>,
    n_batch: usize,
    /// tokens per sequence
    n_ctx: usize,
    n_seq: usize,
    /// cells of the unified KV cache
    kv_cells: usize,
    n_vocab: usize,
}

// SAFETY: used only from the engine thread that owns it.
unsafe impl Send for Context {}

impl Context {
    /// Creates a context on `model`. The caller keeps `model` alive longer than the context.
    ///
    /// # Errors
    /// [`Error::Llama`] when llama.cpp cannot allocate it.
    pub fn new(model: &Model, p: ContextParams) -> Result<Self> {
        let mut capture = Box::new(Capture {
            enabled: p.capture_hidden,
            n_embd: model.n_embd(),
            rows: Vec::new(),
            block: p.capture_block.map(|n| format!("l_out-{n}").into_bytes()),
            block_rows: Vec::new(),
        });
        // SAFETY: default params are plain data; cb_eval_user_data points into a Box whose
        // address is stable and which lives as long as the context (dropped after it).
        let ptr = unsafe {
            let mut cp = sys::llama_context_default_params();
            cp.n_ctx = p
                .kv_cells
                .unwrap_or_else(|| p.n_ctx.saturating_mul(p.n_seq.max(1)));
            cp.n_batch = p.n_batch;
            cp.n_ubatch = p.n_batch;
            cp.n_seq_max = p.n_seq.max(1);
            // one buffer for every sequence: a batch is then one micro-batch in row order (the
            // capture callback sees rows as the batch lists them) and prefixes can be shared
            cp.kv_unified = true;
            cp.n_threads = p.n_threads;
            cp.n_threads_batch = p.n_threads;
            cp.embeddings = false;
            cp.no_perf = true;
            if p.capture_block.is_some() {
                cp.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_DISABLED;
            }
            if p.capture_hidden || p.capture_block.is_some() {
                cp.cb_eval = Some(eval_callback);
                cp.cb_eval_user_data = capture.as_mut() as *mut Capture as *mut c_void;
            }
            sys::llama_init_from_model(model.ptr.as_ptr(), cp)
        };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            Error::Llama(format!("could not create a context of {} tokens", p.n_ctx))
        })?;
        let n_seq = p.n_seq.max(1) as usize;
        // SAFETY: ptr is live.
        let kv_cells = unsafe { sys::llama_n_ctx(ptr.as_ptr()) as usize };
        let n_ctx = (p.n_ctx as usize).min(kv_cells);
        // SAFETY: allocates a token batch of n_batch rows for one sequence.
        let batch = unsafe { sys::llama_batch_init(p.n_batch as i32, 0, 1) };
        Ok(Context {
            ptr,
            batch,
            capture,
            n_batch: p.n_batch as usize,
            n_ctx,
            n_seq,
            kv_cells,
            n_vocab: model.n_vocab(),
        })
    }

    /// The context window of one sequence in tokens.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// The number of sequences.
    pub fn n_seq(&self) -> usize {
        self.n_seq
    }

    /// Cells of the unified KV cache (shared by every sequence).
    pub fn kv_cells(&self) -> usize {
        self.kv_cells
    }

    /// Largest number of tokens decoded in one call.
    pub fn n_batch(&self) -> usize {
        self.n_batch
    }

    /// Drops sequence 0's KV-cache entries from position `from` on.
    pub fn truncate(&mut self, from: usize) {
        self.truncate_seq(0, from);
    }

    /// Drops sequence `seq`'s KV-cache entries from position `from` on (cells another sequence
    /// shares stay for it).
    pub fn truncate_seq(&mut self, seq: usize, from: usize) {
        // SAFETY: ctx is live; the memory handle belongs to it; an unknown seq id is a no-op.
        unsafe {
            let mem = sys::llama_get_memory(self.ptr.as_ptr());
            sys::llama_memory_seq_rm(mem, seq as i32, from as i32, -1);
        }
    }

    /// Empties the KV cache of every sequence (new cells are then placed from the start, so
    /// what follows does not depend on what was cached before).
    pub fn clear(&mut self) {
        // SAFETY: ctx is live; the memory handle belongs to it.
        unsafe {
            let mem = sys::llama_get_memory(self.ptr.as_ptr());
            sys::llama_memory_clear(mem, false);
        }
    }

    /// Makes positions `0..len` of sequence `src` also positions of `dst` (whose cache is
    /// cleared first): the cells are shared, nothing is recomputed.
    pub fn copy_prefix(&mut self, src: usize, dst: usize, len: usize) {
        // SAFETY: ctx is live; the memory handle belongs to it.
        unsafe {
            let mem = sys::llama_get_memory(self.ptr.as_ptr());
            sys::llama_memory_seq_rm(mem, dst as i32, -1, -1);
            sys::llama_memory_seq_cp(mem, src as i32, dst as i32, 0, len as i32);
        }
    }

    /// llama.cpp's serialised KV state of sequence `seq` (positions and keys/values of every
    /// cell it holds), for [`Context::restore_seq`].
    ///
    /// # Errors
    /// [`Error::Llama`] when llama.cpp writes fewer bytes than it asked for.
    pub fn save_seq(&mut self, seq: usize) -> Result<Vec<u8>> {
        // SAFETY: ctx is live; the buffer holds the size llama.cpp asked for.
        unsafe {
            let n = sys::llama_state_seq_get_size(self.ptr.as_ptr(), seq as i32);
            let mut buf = vec![0u8; n];
            let wrote =
                sys::llama_state_seq_get_data(self.ptr.as_ptr(), buf.as_mut_ptr(), n, seq as i32);
            if wrote != n {
                return Err(Error::Llama(format!(
                    "saving sequence {seq}: {wrote} of {n} bytes written"
                )));
            }
            Ok(buf)
        }
    }

    /// Replaces sequence `seq`'s cache with a state from [`Context::save_seq`] (taken from this
    /// context): the same positions with the same keys and values, in whichever free cells
    /// there are.
    ///
    /// # Errors
    /// [`Error::Llama`] when llama.cpp cannot place it (too few free cells); the sequence is
    /// then empty.
    pub fn restore_seq(&mut self, seq: usize, state: &[u8]) -> Result<()> {
        // SAFETY: ctx is live; llama.cpp reads at most state.len() bytes.
        let read = unsafe {
            sys::llama_state_seq_set_data(
                self.ptr.as_ptr(),
                state.as_ptr(),
                state.len(),
                seq as i32,
            )
        };
        if read == 0 {
            self.truncate_seq(seq, 0);
            return Err(Error::Llama(format!(
                "restoring sequence {seq} ({} bytes) failed",
                state.len()
            )));
        }
        Ok(())
    }

    /// Decodes `tokens` of sequence 0 at positions `start..`, requesting outputs on the rows
    /// where `outputs[i]` is true ([`Context::decode_rows`]).
    ///
    /// # Errors
    /// As [`Context::decode_rows`].
    pub fn decode(&mut self, tokens: &[Token], start: usize, outputs: &[bool]) -> Result<Vec<f32>> {
        if tokens.len() != outputs.len() {
            return Err(Error::Invalid(format!(
                "{} tokens with {} output flags",
                tokens.len(),
                outputs.len()
            )));
        }
        let rows: Vec<Row> = tokens
            .iter()
            .zip(outputs)
            .enumerate()
            .map(|(i, (&token, &output))| Row {
                token,
                pos: start + i,
                seq: 0,
                output,
            })
            .collect();
        self.decode_rows(&rows)
    }

    /// Decodes one batch of rows, of any sequences. Returns the hidden states of the output rows
    /// in row order (`n_embd` each) when capture is on; logits are then read with
    /// [`Context::logits`] by row index. The batch is one micro-batch, so rows are computed
    /// in the order given and a row's numbers do not depend on which other rows share it
    /// beyond llama.cpp's own summation order.
    ///
    /// # Errors
    /// [`Error::Llama`] on a decode failure; [`Error::Invalid`] for no rows, more than
    /// `n_batch`, or a sequence id out of range.
    pub fn decode_rows(&mut self, rows: &[Row]) -> Result<Vec<f32>> {
        if rows.len() > self.n_batch || rows.is_empty() {
            return Err(Error::Invalid(format!(
                "decode of {} tokens with batch size {}",
                rows.len(),
                self.n_batch
            )));
        }
        if let Some(r) = rows.iter().find(|r| r.seq >= self.n_seq) {
            return Err(Error::Invalid(format!(
                "sequence {} of a context with {}",
                r.seq, self.n_seq
            )));
        }
        // SAFETY: the batch was allocated for n_batch rows with one seq id each; we write
        // rows.len() <= n_batch rows.
        unsafe {
            let b = &mut self.batch;
            b.n_tokens = rows.len() as i32;
            for (i, r) in rows.iter().enumerate() {
                *b.token.add(i) = r.token;
                *b.pos.add(i) = r.pos as i32;
                *b.n_seq_id.add(i) = 1;
                *(*b.seq_id.add(i)) = r.seq as i32;
                *b.logits.add(i) = i8::from(r.output);
            }
        }
        self.capture.rows.clear();
        self.capture.block_rows.clear();
        // SAFETY: ctx and batch are live and consistent.
        let rc = unsafe { sys::llama_decode(self.ptr.as_ptr(), self.batch) };
        if rc != 0 {
            return Err(Error::Llama(format!("llama_decode returned {rc}")));
        }
        let want = rows.iter().filter(|r| r.output).count() * self.capture.n_embd;
        let hidden = std::mem::take(&mut self.capture.rows);
        if self.capture.enabled && hidden.len() != want {
            return Err(Error::Llama(format!(
                "captured {} hidden values, expected {want} (model graph has no result_norm?)",
                hidden.len()
            )));
        }
        if self.capture.block.is_some()
            && self.capture.block_rows.len() != rows.len() * self.capture.n_embd
        {
            return Err(Error::Llama(format!(
                "captured {} block activations for {} tokens (no such block output?)",
                self.capture.block_rows.len(),
                rows.len()
            )));
        }
        Ok(hidden)
    }

    /// The block activations (`l_out-N`, `n_embd` per row, every row) of the last decode, when
    /// the context captures them; taken, so a second call returns nothing.
    pub fn take_block_rows(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.capture.block_rows)
    }

    /// Makes `lora` (scale 1) the context's only adapter, or removes every adapter with `None`.
    /// The KV cache is not touched: the caller drops positions computed under another adapter.
    ///
    /// # Errors
    /// [`Error::Llama`] when llama.cpp refuses.
    pub fn set_lora(&mut self, lora: Option<&LoraAdapter>) -> Result<()> {
        let mut ptrs: Vec<*mut sys::llama_adapter_lora> =
            lora.iter().map(|l| l.ptr.as_ptr()).collect();
        let mut scales: Vec<f32> = vec![1.0; ptrs.len()];
        // SAFETY: ctx is live; the arrays hold ptrs.len() valid entries for the call.
        let rc = unsafe {
            sys::llama_set_adapters_lora(
                self.ptr.as_ptr(),
                ptrs.as_mut_ptr(),
                ptrs.len(),
                scales.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(Error::Llama(format!(
                "llama_set_adapters_lora returned {rc}"
            )));
        }
        Ok(())
    }

    /// The logits of batch row `i` of the last decode; that row must have requested output.
    pub fn logits(&self, i: usize) -> &[f32] {
        // SAFETY: llama.cpp returns a pointer to n_vocab floats valid until the next decode,
        // and `&self` borrows keep decode (which takes `&mut self`) from running meanwhile.
        unsafe {
            let p = sys::llama_get_logits_ith(self.ptr.as_ptr(), i as i32);
            assert!(!p.is_null(), "logits requested for a row without output");
            std::slice::from_raw_parts(p, self.n_vocab)
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: batch and ctx were allocated by llama.cpp and are freed once; the capture box
        // is dropped after the context that pointed to it.
        unsafe {
            sys::llama_batch_free(self.batch);
            sys::llama_free(self.ptr.as_ptr());
        }
    }
}

/// ggml's dequantisation of `n` values of type `ty` from `src` into f32.
///
/// # Errors
/// [`Error::Invalid`] for a type ggml cannot convert to float.
pub fn dequantize(ty: u32, src: &[u8], n: usize) -> Result<Vec<f32>> {
    // SAFETY: ggml returns static trait tables; to_float reads exactly the bytes of n values,
    // which the caller sized `src` for (checked below).
    unsafe {
        let tr = sys::ggml_get_type_traits(ty as sys::ggml_type);
        if tr.is_null() {
            return Err(Error::Invalid(format!("unknown ggml type {ty}")));
        }
        let tr = &*tr;
        let need = n / tr.blck_size as usize * tr.type_size;
        if !n.is_multiple_of(tr.blck_size as usize) || src.len() < need {
            return Err(Error::Invalid(format!(
                "{} bytes cannot hold {n} values of ggml type {ty}",
                src.len()
            )));
        }
        let mut out = vec![0f32; n];
        if ty == sys::GGML_TYPE_Q8_1 {
            // ggml has no to_float for Q8_1 (it is only an activation format):
            // blocks of {f16 d, f16 s, i8 qs[32]}, value = d * q.
            for (b, blk) in src[..need].chunks_exact(36).enumerate() {
                let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                for j in 0..32 {
                    out[b * 32 + j] = d * f32::from(blk[4 + j] as i8);
                }
            }
            return Ok(out);
        }
        if ty == sys::GGML_TYPE_Q8_K {
            // nor for Q8_K (the activation format of k-quant weights): blocks of {f32 d,
            // i8 qs[256], i16 bsums[16]}, value = d * q.
            for (b, blk) in src[..need].chunks_exact(tr.type_size).enumerate() {
                let d = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]);
                for j in 0..256 {
                    out[b * 256 + j] = d * f32::from(blk[4 + j] as i8);
                }
            }
            return Ok(out);
        }
        if ty == sys::GGML_TYPE_F32 {
            std::ptr::copy_nonoverlapping(src.as_ptr() as *const f32, out.as_mut_ptr(), n);
            return Ok(out);
        }
        let f = tr
            .to_float
            .ok_or_else(|| Error::Invalid(format!("ggml type {ty} has no to_float")))?;
        f(src.as_ptr() as *const c_void, out.as_mut_ptr(), n as i64);
        Ok(out)
    }
}

/// Bytes taken by `n` values of ggml type `ty`.
///
/// # Errors
/// [`Error::Invalid`] for an unknown type or a length that is not a multiple of its block.
pub fn row_size(ty: u32, n: usize) -> Result<usize> {
    // SAFETY: static trait table lookup.
    let tr = unsafe { sys::ggml_get_type_traits(ty as sys::ggml_type) };
    if tr.is_null() {
        return Err(Error::Invalid(format!("unknown ggml type {ty}")));
    }
    // SAFETY: non-null static table.
    let tr = unsafe { &*tr };
    let blck = tr.blck_size.max(1) as usize;
    if tr.type_size == 0 || !n.is_multiple_of(blck) {
        return Err(Error::Invalid(format!(
            "{n} values do not fill blocks of ggml type {ty}"
        )));
    }
    Ok(n / blck * tr.type_size)
}

/// The type the CPU backend converts activations to before a matmul with a weight of type
/// `weight_ty` (e.g. Q8_0 for Q8_0 weights, Q8_1 for Q4_1).
pub fn vec_dot_type(weight_ty: u32) -> u32 {
    // SAFETY: static trait table lookup.
    unsafe {
        let tr = sys::ggml_get_type_traits_cpu(weight_ty as sys::ggml_type);
        if tr.is_null() {
            return sys::GGML_TYPE_F32;
        }
        (*tr).vec_dot_type
    }
}

/// Rounds a row of activations through `ty` the way the CPU backend does before its matmul
/// (quantise with the CPU `from_float`, then dequantise), so that an f32 matmul against the
/// dequantised weight reproduces llama.cpp's logits.
///
/// # Errors
/// [`Error::Invalid`] when the row length is not a multiple of the type's block size.
pub fn round_through(ty: u32, row: &[f32]) -> Result<Vec<f32>> {
    if ty == sys::GGML_TYPE_F32 {
        return Ok(row.to_vec());
    }
    // SAFETY: static trait tables; buffers sized from the type's block and type sizes.
    unsafe {
        let tr = &*sys::ggml_get_type_traits(ty as sys::ggml_type);
        let cpu = sys::ggml_get_type_traits_cpu(ty as sys::ggml_type);
        let blck = tr.blck_size as usize;
        if !row.len().is_multiple_of(blck) {
            return Err(Error::Invalid(format!(
                "row of {} is not a multiple of {blck}",
                row.len()
            )));
        }
        let from = if cpu.is_null() {
            None
        } else {
            (*cpu).from_float
        }
        .or(tr.from_float_ref)
        .ok_or_else(|| Error::Invalid(format!("ggml type {ty} has no from_float")))?;
        let mut q = vec![0u8; row.len() / blck * tr.type_size];
        from(
            row.as_ptr(),
            q.as_mut_ptr() as *mut c_void,
            row.len() as i64,
        );
        dequantize(ty, &q, row.len())
    }
}

/// A weight type (or mix) llama.cpp's quantizer can write: a `llama_ftype`, plus two mixes of
/// ours where the FFN down-projections, the only matrices of the default model whose rows are a
/// multiple of 256 values, are Q4_K (4-bit with a scale and a minimum per 32 weights, like
/// Q4_1, so it holds a Q4_1 matrix almost exactly) and the rest is Q4_0 or IQ4_NL.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileType {
    /// 4-bit, one f16 scale per 32 weights; repacked for batched GEMM on AVX2 / NEON
    Q4_0,
    /// 4-bit with a scale and a minimum per 32 weights (the shipped default model)
    Q4_1,
    /// 4-bit non-linear codebook, one scale per 32 weights, repacked like Q4_0
    IQ4_NL,
    /// 8-bit, tinyBLAS for prompts on x86
    Q8_0,
    /// llama.cpp's k-quant mix, 4-bit medium (rows not a multiple of 256 fall back to 32-blocks)
    Q4_K_M,
    /// Q4_0, with `ffn_down` in Q4_K (both repacked on AVX2)
    Q4_0_M,
    /// IQ4_NL, with `ffn_down` in Q4_K (both repacked on AVX2)
    IQ4_NL_M,
}

impl FileType {
    /// Every type `turnwise convert` accepts.
    pub const ALL: [FileType; 7] = [
        FileType::Q4_0,
        FileType::Q4_1,
        FileType::IQ4_NL,
        FileType::Q8_0,
        FileType::Q4_K_M,
        FileType::Q4_0_M,
        FileType::IQ4_NL_M,
    ];

    /// The name (llama.cpp's for its own types: `Q4_0`, `IQ4_NL`, …).
    pub fn name(self) -> &'static str {
        match self {
            FileType::Q4_0 => "Q4_0",
            FileType::Q4_1 => "Q4_1",
            FileType::IQ4_NL => "IQ4_NL",
            FileType::Q8_0 => "Q8_0",
            FileType::Q4_K_M => "Q4_K_M",
            FileType::Q4_0_M => "Q4_0_M",
            FileType::IQ4_NL_M => "IQ4_NL_M",
        }
    }

    /// Parses a type name, case-insensitively.
    pub fn parse(s: &str) -> Option<FileType> {
        FileType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s.trim()))
    }

    fn ftype(self) -> sys::llama_ftype {
        match self {
            FileType::Q4_0 | FileType::Q4_0_M => sys::LLAMA_FTYPE_MOSTLY_Q4_0,
            FileType::Q4_1 => sys::LLAMA_FTYPE_MOSTLY_Q4_1,
            FileType::IQ4_NL | FileType::IQ4_NL_M => sys::LLAMA_FTYPE_MOSTLY_IQ4_NL,
            FileType::Q8_0 => sys::LLAMA_FTYPE_MOSTLY_Q8_0,
            FileType::Q4_K_M => sys::LLAMA_FTYPE_MOSTLY_Q4_K_M,
        }
    }

    /// Tensor-name patterns (llama.cpp regexes) written in another type than the file's.
    fn overrides(self) -> &'static [(&'static str, u32)] {
        match self {
            FileType::Q4_0_M | FileType::IQ4_NL_M => &[("ffn_down", sys::GGML_TYPE_Q4_K)],
            _ => &[],
        }
    }
}

impl std::fmt::Display for FileType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Name of a `general.file_type` value as llama.cpp prints it (e.g. `Q4_1`), or `type N`.
pub fn ftype_name(ftype: u32) -> String {
    // SAFETY: llama_ftype_name returns a static string for every value (an "unknown" one for
    // values it does not know).
    let s = unsafe { CStr::from_ptr(sys::llama_ftype_name(ftype as sys::llama_ftype)) };
    let s = s.to_string_lossy();
    // "Q4_0" / "Q4_K - Medium" / "IQ4_NL - 4.5 bpw": keep the short form
    s.split(" - ")
        .next()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| format!("type {ftype}"))
}

/// Name of a ggml tensor type (`q4_0`, `q8_0`, `f32`, …).
pub fn ggml_type_name(ty: u32) -> String {
    // SAFETY: ggml_type_name returns a static string, or null for an unknown type.
    unsafe {
        let p = sys::ggml_type_name(ty as sys::ggml_type);
        if p.is_null() {
            format!("type {ty}")
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

/// Writes `dst` as `src` requantised to `ty` by llama.cpp's own quantizer
/// (`llama_model_quantize` with `allow_requantize`, no importance matrix; the output and
/// token-embedding tensors follow llama.cpp's per-type rules). `dst` is overwritten.
///
/// # Errors
/// [`Error::BadModel`] when llama.cpp refuses the input or cannot write the output.
pub fn quantize(src: &Path, dst: &Path, ty: FileType, n_threads: i32) -> Result<()> {
    let bad = |path: &Path, reason: &str| Error::BadModel {
        path: path.into(),
        reason: reason.into(),
    };
    let csrc = CString::new(src.to_string_lossy().as_bytes())
        .map_err(|_| bad(src, "path contains a NUL byte"))?;
    let cdst = CString::new(dst.to_string_lossy().as_bytes())
        .map_err(|_| bad(dst, "path contains a NUL byte"))?;
    let patterns: Vec<CString> = ty
        .overrides()
        .iter()
        .filter_map(|(p, _)| CString::new(*p).ok())
        .collect();
    // a null pattern ends the list
    let mut overrides: Vec<sys::llama_model_tensor_override> = patterns
        .iter()
        .zip(ty.overrides())
        .map(|(p, (_, t))| sys::llama_model_tensor_override {
            pattern: p.as_ptr(),
            type_: *t as sys::ggml_type,
        })
        .collect();
    overrides.push(sys::llama_model_tensor_override {
        pattern: std::ptr::null(),
        type_: 0,
    });
    // SAFETY: default params are plain data (null pointers for imatrix, key overrides and
    // pruning); the paths, the patterns and the override list outlive the call, and the list
    // ends with a null pattern.
    let rc = unsafe {
        let mut p = sys::llama_model_quantize_default_params();
        p.nthread = n_threads;
        p.ftype = ty.ftype();
        p.allow_requantize = true;
        if overrides.len() > 1 {
            p.tt_overrides = overrides.as_ptr();
        }
        sys::llama_model_quantize(csrc.as_ptr(), cdst.as_ptr(), &p)
    };
    if rc != 0 {
        return Err(bad(
            src,
            &format!(
                "llama.cpp's quantizer failed to write {} as {ty} (status {rc}; run with -v to see its log)",
                dst.display()
            ),
        ));
    }
    Ok(())
}

/// The lines llama.cpp logged while `f` ran (its log callback is swapped for a collecting one
/// and put back afterwards). Used to read what the model loader reports, such as the size of
/// each weight buffer type (`CPU_REPACK model buffer size = …`).
pub fn capture_log<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
    unsafe extern "C" fn collect(
        _level: sys::ggml_log_level,
        text: *const c_char,
        ud: *mut c_void,
    ) {
        if text.is_null() || ud.is_null() {
            return;
        }
        // SAFETY: ud is the Vec<String> below, alive and exclusively used by this callback
        // while the capture lasts; text is a NUL-terminated string from llama.cpp.
        let lines = &mut *(ud as *mut Vec<String>);
        lines.push(CStr::from_ptr(text).to_string_lossy().into_owned());
    }
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mut lines: Vec<String> = Vec::new();
    let mut prev_cb: sys::ggml_log_callback = None;
    let mut prev_ud: *mut c_void = std::ptr::null_mut();
    // SAFETY: llama_log_get/set swap a global callback; the collecting one only runs while
    // `lines` lives (restored before it is dropped). Other threads logging meanwhile land in
    // `lines` too, which is harmless.
    let out = unsafe {
        sys::llama_log_get(&mut prev_cb, &mut prev_ud);
        sys::llama_log_set(Some(collect), &mut lines as *mut Vec<String> as *mut c_void);
        let out = f();
        sys::llama_log_set(prev_cb, prev_ud);
        out
    };
    // llama.cpp logs a line in pieces: join them, then split on newlines
    let text = lines.concat();
    (out, text.lines().map(str::to_string).collect())
}
