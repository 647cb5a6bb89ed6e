"""Cases a and i, vLLM side: one plain float32 engine (in this process) for both, case a's greedy
job first, then case i's sampling fields.

Input: ``{"model", "greedy": <a_greedy.py's job>, "sampling": <i_sampling.py's job>}``. Output:
``{"greedy": ..., "sampling": ..., "start_s", "generate_s"}``.
"""
from a_greedy import run_greedy
from common import Timer, make_llm, read_input, shutdown, write_output
from i_sampling import run_sampling

if __name__ == "__main__":            # vLLM may spawn processes: the guard is required
    args = read_input()
    timer = Timer()
    llm = make_llm(args["model"], dtype="float32")
    start = timer()
    greedy = run_greedy(llm, args["greedy"])
    sampling = run_sampling(llm, args["sampling"])
    write_output({"greedy": greedy, "sampling": sampling, "start_s": start,
                  "generate_s": round(timer() - start, 2)})
    shutdown(llm)
