//! Model file formats: GGUF and safetensors (+ `config.json`) loaded by mmap,
//! tokenizers (GGUF-embedded and `tokenizer.json`), and chat templates.
//!
//! Bad files give errors that name the file and what is wrong, never a panic.

pub mod bytes;
pub mod cache;
pub mod dtype;
#[doc(hidden)]
pub mod fuzz;
pub mod gguf;
pub mod images;
pub mod safetensors;
pub mod template;
pub mod tensor;
pub mod tokenizer;

pub use bytes::Bytes;
pub use dtype::DType;
pub use tensor::TensorView;
