// Placeholder: the CUDA emulation header (owned by the executor helper) replaces this file at merge.
