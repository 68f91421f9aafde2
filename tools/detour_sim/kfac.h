// `detour-sim kfac`: utilisation before and after filling the pipeline's
// bubbles with K-FAC work (coordinator/planner/bubble_planner.h), on a
// synthetic uniform GPipe / 1F1B / Chimera pipeline with a per-block profile, or on a
// planned iteration of a real cluster and job. See docs/KFAC.md.
#ifndef DETOUR_TOOLS_DETOUR_SIM_KFAC_H_
#define DETOUR_TOOLS_DETOUR_SIM_KFAC_H_

#include <string>
#include <vector>

namespace detour::sim_tool {

// Runs the subcommand on `args` (everything after "kfac"; flags parsed by
// common/flags.h's FlagSet, --help generated). Returns the exit status: 0
// success or --help, 1 bad input or failed plan, 2 bad usage (message on
// stderr naming the flag).
int RunKfac(const std::vector<std::string>& args);

}  // namespace detour::sim_tool

#endif  // DETOUR_TOOLS_DETOUR_SIM_KFAC_H_
