// Prometheus HTTP service discovery (http_sd_configs) served by the
// coordinator on its metrics port: one scrape job finds the coordinator and
// every registered worker that serves /metrics. See docs/OPERATIONS.md
// §Monitoring and docs/METRICS.md §Service discovery.
#ifndef DETOUR_COORDINATOR_SERVICE_DISCOVERY_H_
#define DETOUR_COORDINATOR_SERVICE_DISCOVERY_H_

#include <string>
#include <vector>

#include "detour/v1/control_service.pb.h"

namespace detour {

// Path of the discovery document on the coordinator's metrics HTTP port.
inline constexpr char kServiceDiscoveryPath[] = "/prometheus/targets";

// The JSON document Prometheus's http_sd_configs reads: a list of target
// groups, [{"targets": ["host:port"], "labels": {...}}, ...]. The first group
// is the coordinator (`coordinator_target`, omitted when empty), labelled
// role="coordinator"; then one group per worker with a metrics address,
// sorted by worker id, labelled role="worker" plus __meta_detour_worker_id,
// __meta_detour_region, __meta_detour_device and __meta_detour_worker_state
// (idle, busy, lost) for relabelling. Lost workers stay listed until the
// registry forgets them, so their targets show up as down. Pure function.
std::string ServiceDiscoveryJson(const std::string& coordinator_target,
                                 const std::vector<v1::WorkerInfo>& workers);

}  // namespace detour

#endif  // DETOUR_COORDINATOR_SERVICE_DISCOVERY_H_
