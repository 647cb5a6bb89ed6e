"""Notebook 03's exercise "how many chunks does a prompt of n tokens match?" (for teachers)."""


def num_chunks(num_prompt_tokens, block_size=16, chunk_size=64):
    stored = (num_prompt_tokens - 1) // block_size * block_size    # whole blocks below the last token
    return -(-stored // chunk_size)                                 # ceil


if __name__ == "__main__":
    print({n: num_chunks(n) for n in (16, 17, 65, 81, 1000)})
