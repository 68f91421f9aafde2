#include "coordinator/etcd/etcd_client.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/net/address.h"
#include "common/net/grpc_status.h"
#include "common/status.h"

namespace detour {
namespace {

constexpr size_t kMaxEndpoints = 16;

EtcdKeyValue FromProto(const etcdserverpb::KeyValue& kv) {
  return EtcdKeyValue{kv.key(),          kv.value(),   kv.create_revision(),
                      kv.mod_revision(), kv.version(), kv.lease()};
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseEtcdUrl(absl::string_view url,
                                                      absl::string_view flag) {
  constexpr absl::string_view kScheme = "etcd://";
  if (!absl::StartsWith(url, kScheme)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", url, "\" is not etcd://host:port[,host:port...]"));
  }
  std::vector<std::string> endpoints;
  for (absl::string_view part : absl::StrSplit(url.substr(kScheme.size()), ',')) {
    ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(part, flag, /*allow_port_zero=*/false));
    if (hp.host.empty() || hp.host == "0.0.0.0") {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": \"", part, "\" names no host to connect to"));
    }
    endpoints.push_back(hp.ToString());
  }
  if (endpoints.size() > kMaxEndpoints) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", endpoints.size(), " endpoints; at most ", kMaxEndpoints));
  }
  return endpoints;
}

std::string EtcdPrefixEnd(absl::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

etcdserverpb::Compare EtcdModRevisionIs(const std::string& key, int64_t revision) {
  etcdserverpb::Compare compare;
  compare.set_result(etcdserverpb::Compare::EQUAL);
  compare.set_target(etcdserverpb::Compare::MOD);
  compare.set_key(key);
  compare.set_mod_revision(revision);
  return compare;
}

etcdserverpb::Compare EtcdCreateRevisionIs(const std::string& key, int64_t revision) {
  etcdserverpb::Compare compare;
  compare.set_result(etcdserverpb::Compare::EQUAL);
  compare.set_target(etcdserverpb::Compare::CREATE);
  compare.set_key(key);
  compare.set_create_revision(revision);
  return compare;
}

etcdserverpb::RequestOp EtcdPutOp(const std::string& key, const std::string& value, int64_t lease) {
  etcdserverpb::RequestOp op;
  op.mutable_request_put()->set_key(key);
  op.mutable_request_put()->set_value(value);
  op.mutable_request_put()->set_lease(lease);
  return op;
}

etcdserverpb::RequestOp EtcdGetOp(const std::string& key) {
  etcdserverpb::RequestOp op;
  op.mutable_request_range()->set_key(key);
  return op;
}

etcdserverpb::RequestOp EtcdDeleteOp(const std::string& key) {
  etcdserverpb::RequestOp op;
  op.mutable_request_delete_range()->set_key(key);
  return op;
}

EtcdClient::EtcdClient(EtcdOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(EtcdOptions options) {
  if (options.endpoints.empty() || options.endpoints.size() > kMaxEndpoints) {
    return absl::InvalidArgumentError(
        absl::StrCat("etcd: ", options.endpoints.size(), " endpoints; 1 to ", kMaxEndpoints));
  }
  if (options.call_timeout <= absl::ZeroDuration() || options.max_request_bytes == 0 ||
      options.max_response_bytes <= 0 || options.max_range_keys <= 0) {
    return absl::InvalidArgumentError("etcd: the timeout and every limit must be positive");
  }
  std::unique_ptr<EtcdClient> client(new EtcdClient(std::move(options)));
  for (const std::string& endpoint : client->options_.endpoints) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(client->options_.max_response_bytes);
    // A member that restarts is found again within a second or two.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
    // The least time one connection attempt is given (gRPC's default is 20 s).
    // etcd accepts connections before it serves them; an attempt that hangs
    // there is given up within a call's deadline and made again.
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
                static_cast<int>(absl::ToInt64Milliseconds(client->options_.call_timeout)));
    auto channel =
        grpc::CreateCustomChannel(endpoint, client->options_.security.ChannelCredentials(), args);
    client->members_.push_back(Member{endpoint, etcdserverpb::KV::NewStub(channel),
                                      etcdserverpb::Lease::NewStub(channel)});
  }
  return client;
}

absl::Status EtcdAnswerStatus(const grpc::Status& status) {
  absl::Status s = FromGrpcStatus(status);
  if (s.code() != absl::StatusCode::kUnknown) return s;
  if (s.message() == "context deadline exceeded") return absl::DeadlineExceededError(s.message());
  if (s.message() == "context canceled") return absl::UnavailableError(s.message());
  return s;
}

std::string EtcdClient::Describe() const {
  return absl::StrCat("etcd://", absl::StrJoin(options_.endpoints, ","));
}

absl::Status EtcdClient::Invoke(absl::string_view op, size_t request_bytes,
                                const Attempt& attempt) {
  if (request_bytes > options_.max_request_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("etcd ", op, ": the request is ", request_bytes, " bytes; etcd takes at most ",
                     options_.max_request_bytes, " per request (its --max-request-bytes)"));
  }
  // Attempts get a third of the call's time each, so that one member stuck
  // on a request (its raft leader just died) leaves time to ask again; the
  // members are asked in turn until the call's deadline.
  const absl::Time deadline = absl::Now() + options_.call_timeout;
  const absl::Duration per_attempt = options_.call_timeout / 3;
  size_t index = preferred_.load() % members_.size();
  std::vector<std::string> failures;
  while (absl::Now() < deadline) {
    Member& member = members_[index];
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(std::min(deadline, absl::Now() + per_attempt)));
    const absl::Status error = EtcdAnswerStatus(attempt(member, &context));
    if (error.ok()) {
      preferred_.store(index);
      return absl::OkStatus();
    }
    if (error.code() != absl::StatusCode::kUnavailable &&
        error.code() != absl::StatusCode::kDeadlineExceeded) {
      return absl::Status(
          error.code(), absl::StrCat("etcd ", op, " at ", member.endpoint, ": ", error.message()));
    }
    if (failures.size() < members_.size()) {
      failures.push_back(absl::StrCat(member.endpoint, ": ", error.message()));
    }
    index = (index + 1) % members_.size();
    // A whole round refused: a short pause before the next (no leader yet).
    if (index == preferred_.load() % members_.size()) absl::SleepFor(absl::Milliseconds(100));
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "etcd ", op, ": no member answered within ", absl::FormatDuration(options_.call_timeout),
      " (is a quorum of the etcd members up?)", op == "Range" ? "" : "; its outcome is unknown",
      ": ", absl::StrJoin(failures, "; ")));
}

absl::Status EtcdClient::CheckRange(absl::string_view op,
                                    const etcdserverpb::RangeResponse& response,
                                    int64_t limit) const {
  const int64_t most = limit > 0 ? limit : options_.max_range_keys;
  if (response.kvs_size() > most) {
    return absl::DataLossError(absl::StrCat("etcd ", op, ": ", response.kvs_size(),
                                            " keys returned for a limit of ", most));
  }
  for (const etcdserverpb::KeyValue& kv : response.kvs()) {
    if (kv.key().empty() || kv.mod_revision() <= 0 || kv.create_revision() <= 0) {
      return absl::DataLossError(
          absl::StrCat("etcd ", op, ": a key with an empty name or no revision returned"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<EtcdClient::RangeResult> EtcdClient::Range(const std::string& key,
                                                          const std::string& range_end,
                                                          int64_t limit, int64_t revision) {
  etcdserverpb::RangeRequest request;
  request.set_key(key);
  request.set_range_end(range_end);
  const int64_t most =
      limit > 0 ? std::min(limit, options_.max_range_keys) : options_.max_range_keys;
  request.set_limit(most);
  request.set_revision(revision);
  etcdserverpb::RangeResponse response;
  RETURN_IF_ERROR(Invoke("Range", request.ByteSizeLong(), [&](Member& m, grpc::ClientContext* c) {
    return m.kv->Range(c, request, &response);
  }));
  RETURN_IF_ERROR(CheckRange("Range", response, most));
  RangeResult result;
  result.more = response.more();
  result.revision = response.header().revision();
  result.kvs.reserve(response.kvs_size());
  for (const auto& kv : response.kvs()) result.kvs.push_back(FromProto(kv));
  return result;
}

absl::StatusOr<std::optional<EtcdKeyValue>> EtcdClient::Get(const std::string& key) {
  ASSIGN_OR_RETURN(RangeResult result, Range(key, "", 1));
  if (result.kvs.empty()) return std::nullopt;
  return result.kvs.front();
}

absl::StatusOr<int64_t> EtcdClient::Put(const std::string& key, const std::string& value,
                                        int64_t lease) {
  etcdserverpb::PutRequest request;
  request.set_key(key);
  request.set_value(value);
  request.set_lease(lease);
  etcdserverpb::PutResponse response;
  RETURN_IF_ERROR(Invoke("Put", request.ByteSizeLong(), [&](Member& m, grpc::ClientContext* c) {
    return m.kv->Put(c, request, &response);
  }));
  return response.header().revision();
}

absl::StatusOr<int64_t> EtcdClient::DeleteRange(const std::string& key,
                                                const std::string& range_end) {
  etcdserverpb::DeleteRangeRequest request;
  request.set_key(key);
  request.set_range_end(range_end);
  etcdserverpb::DeleteRangeResponse response;
  RETURN_IF_ERROR(Invoke(
      "DeleteRange", request.ByteSizeLong(),
      [&](Member& m, grpc::ClientContext* c) { return m.kv->DeleteRange(c, request, &response); }));
  return response.deleted();
}

absl::StatusOr<etcdserverpb::TxnResponse> EtcdClient::Txn(const etcdserverpb::TxnRequest& request) {
  etcdserverpb::TxnResponse response;
  RETURN_IF_ERROR(Invoke("Txn", request.ByteSizeLong(), [&](Member& m, grpc::ClientContext* c) {
    return m.kv->Txn(c, request, &response);
  }));
  const auto& ops = response.succeeded() ? request.success() : request.failure();
  if (response.responses_size() != ops.size()) {
    return absl::DataLossError(absl::StrCat("etcd Txn: ", response.responses_size(),
                                            " responses for ", ops.size(), " operations"));
  }
  for (const etcdserverpb::ResponseOp& op : response.responses()) {
    if (op.has_response_range()) {
      // A range inside a transaction has no limit of ours: one key each.
      RETURN_IF_ERROR(CheckRange("Txn", op.response_range(), 1));
    }
  }
  return response;
}

absl::StatusOr<EtcdClient::Lease> EtcdClient::LeaseGrant(absl::Duration ttl) {
  const int64_t seconds = absl::ToInt64Seconds(absl::Ceil(ttl, absl::Seconds(1)));
  if (seconds < 1) return absl::InvalidArgumentError("etcd LeaseGrant: the TTL must be >= 1 s");
  etcdserverpb::LeaseGrantRequest request;
  request.set_ttl(seconds);
  etcdserverpb::LeaseGrantResponse response;
  RETURN_IF_ERROR(
      Invoke("LeaseGrant", request.ByteSizeLong(), [&](Member& m, grpc::ClientContext* c) {
        return m.lease->LeaseGrant(c, request, &response);
      }));
  if (!response.error().empty() || response.id() == 0 || response.ttl() <= 0) {
    return absl::InternalError(absl::StrCat("etcd LeaseGrant: no lease (", response.error(), ")"));
  }
  return Lease{response.id(), absl::Seconds(response.ttl())};
}

absl::StatusOr<absl::Duration> EtcdClient::LeaseKeepAliveOnce(int64_t id) {
  etcdserverpb::LeaseKeepAliveRequest request;
  request.set_id(id);
  etcdserverpb::LeaseKeepAliveResponse response;
  bool answered = false;
  RETURN_IF_ERROR(
      Invoke("LeaseKeepAlive", request.ByteSizeLong(), [&](Member& m, grpc::ClientContext* c) {
        auto stream = m.lease->LeaseKeepAlive(c);
        answered = stream->Write(request) && stream->Read(&response);
        stream->WritesDone();
        // One request, so at most one answer: nothing is left to drain.
        grpc::Status status = stream->Finish();
        if (status.ok() && !answered) {
          return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the stream ended without an answer");
        }
        return status;
      }));
  if (response.ttl() <= 0) {
    return absl::NotFoundError(
        absl::StrCat("etcd LeaseKeepAlive: lease ", absl::Hex(id), " expired or was revoked"));
  }
  return absl::Seconds(response.ttl());
}

absl::Status EtcdClient::LeaseRevoke(int64_t id) {
  etcdserverpb::LeaseRevokeRequest request;
  request.set_id(id);
  etcdserverpb::LeaseRevokeResponse response;
  absl::Status revoked =
      Invoke("LeaseRevoke", request.ByteSizeLong(), [&](Member& m, grpc::ClientContext* c) {
        return m.lease->LeaseRevoke(c, request, &response);
      });
  // Gone already (expired, or an earlier attempt of this call landed).
  if (revoked.code() == absl::StatusCode::kNotFound) return absl::OkStatus();
  return revoked;
}

}  // namespace detour
