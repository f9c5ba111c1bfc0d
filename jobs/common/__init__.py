"""What the jobs share (errors, reporting, settings, the metrics document, memory checks, LoRA, task choice,
local workers, Hugging Face names and tokenizers): the floor below the jobs, importing none of them."""
