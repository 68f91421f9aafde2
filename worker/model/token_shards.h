// Prepared datasets: text, directories of text and JSONL turned once into
// pre-tokenised token files that workers map instead of reading (`detour-data
// prepare`, docs/DATA.md). A dataset directory holds
//   manifest.json        v1::DatasetManifest as JSON (tokenizer, counts, checksums)
//   train.tokens         the training split's ids, uint16 (vocabulary <= 65536)
//   validation.tokens    or uint32, little-endian, documents back to back
//   train.index          uint64 little-endian token offsets of the documents:
//   validation.index     documents+1 entries, 0 first and the token count last
//   tokenizer.model      the SentencePiece model (absent for the byte tokenizer)
// Documents are split into train and validation by a seeded hash of their
// index, so the split is by document and does not depend on the machine.
// No LibTorch. Functions are thread-safe; a ShardDataset is immutable.
#ifndef DETOUR_WORKER_MODEL_TOKEN_SHARDS_H_
#define DETOUR_WORKER_MODEL_TOKEN_SHARDS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "detour/v1/spec.pb.h"
#include "common/checkpoint_manifest.h"
#include "worker/model/text_data.h"
#include "worker/model/tokenizer.h"

namespace detour::model {

inline constexpr char kDatasetFormat[] = "detour-dataset-v1";
// Bounds a dataset must respect (it is input like any other).
struct DatasetLimits {
  static constexpr uint64_t kMaxManifestBytes = 16 << 20;
  static constexpr uint64_t kMaxTokens = uint64_t{1} << 40;
  static constexpr uint64_t kMaxDocuments = uint64_t{1} << 36;
  static constexpr size_t kMaxSources = 1000000;
  // A JSONL line (one document) or a text document, in bytes.
  static constexpr uint64_t kMaxDocumentBytes = uint64_t{64} << 20;
  // Text read by one `prepare` in all.
  static constexpr uint64_t kMaxInputBytes = uint64_t{1} << 40;
};

// How a text file (not JSONL) is cut into documents.
enum class TextDocuments { kParagraphs, kLines, kFiles };

// One file the inputs named, once read to its end.
struct InputSource {
  std::string path;
  uint64_t bytes = 0;
  uint64_t documents = 0;  // non-empty documents it gave
};

// The documents of text files, directories of them and JSONL, one at a time,
// in the order, with the cutting, the checks and the limits of PrepareDataset
// (which reads through it; `detour-data tokenizer` streams it into spm_train):
// files of a directory in byte order of their paths, a text file cut per
// `text_documents`, a .jsonl file one document per non-blank line (its
// `jsonl_field`). Documents are non-empty valid UTF-8 and keep their line
// ends. Holds one document and one line buffer at a time. Thread-compatible.
class DocumentReader {
 public:
  // Lists the inputs (NOT_FOUND for a missing one, INVALID_ARGUMENT for a
  // device or FIFO, RESOURCE_EXHAUSTED beyond DatasetLimits,
  // FAILED_PRECONDITION for no file at all); reads nothing yet.
  static absl::StatusOr<std::unique_ptr<DocumentReader>> Open(
      const std::vector<std::string>& inputs, TextDocuments text_documents,
      const std::string& jsonl_field);
  ~DocumentReader();
  DocumentReader(const DocumentReader&) = delete;
  DocumentReader& operator=(const DocumentReader&) = delete;

  // The next document into `text`, and into `where` the file and line it
  // starts at ("a.jsonl:2"). False at the end of the inputs. INVALID_ARGUMENT
  // naming the file and line for a bad JSONL line, invalid UTF-8 or a
  // document over DatasetLimits::kMaxDocumentBytes; NOT_FOUND for a file that
  // cannot be opened; DATA_LOSS for a read error. After an error the reader
  // stays failed.
  absl::StatusOr<bool> Next(std::string* text, std::string* where);

  uint64_t bytes_total() const { return bytes_total_; }
  // Bytes of the inputs consumed so far.
  uint64_t bytes_done() const;
  // The files read to their end so far, in reading order.
  const std::vector<InputSource>& sources() const { return sources_; }

 private:
  class LineReader;
  DocumentReader() = default;
  absl::StatusOr<bool> Emit(std::string* doc, const std::string& where, std::string* text,
                            std::string* where_out);
  void FinishFile();

  std::vector<std::string> files_;
  TextDocuments text_documents_ = TextDocuments::kParagraphs;
  std::string jsonl_field_;
  uint64_t bytes_total_ = 0;
  uint64_t bytes_before_ = 0;  // of the files finished
  size_t next_file_ = 0;
  std::unique_ptr<LineReader> reader_;
  bool jsonl_ = false;
  std::string doc_;        // paragraph or file being gathered
  uint64_t doc_line_ = 0;  // its first line
  uint64_t file_documents_ = 0;
  std::vector<InputSource> sources_;
  absl::Status status_;
};

struct PrepareProgress {
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
  uint64_t documents = 0;
  uint64_t tokens = 0;
};

struct PrepareOptions {
  // Files or directories (read recursively, in byte order of their paths).
  // Files ending in .jsonl hold one JSON object per line with the text in
  // `jsonl_field`; every other file is UTF-8 text.
  std::vector<std::string> inputs;
  std::string output;                 // the dataset directory; must not exist unless `force`
  std::string tokenizer_path;         // "" = byte tokenizer, else a SentencePiece .model
  double validation_fraction = 0.05;  // in [0, 0.5]
  uint64_t split_seed = 0;
  std::string jsonl_field = "text";
  TextDocuments text_documents = TextDocuments::kParagraphs;
  bool force = false;  // replace an existing dataset directory
  // Called now and then (at most a few times a second) and at the end.
  std::function<void(const PrepareProgress&)> progress;
};

// Reads, tokenises and writes a dataset; the directory appears complete or
// not at all (built beside it, synced, then renamed). NOT_FOUND for a missing
// input, INVALID_ARGUMENT naming the file and line for a bad JSONL line or
// invalid UTF-8, ALREADY_EXISTS for an existing output without `force`,
// FAILED_PRECONDITION when there is no text or too few documents for the
// validation split asked.
absl::StatusOr<v1::DatasetManifest> PrepareDataset(const PrepareOptions& options);

// What `detour-data tokenizer` trained on.
struct TokenizerCorpus {
  int64_t lines = 0;
  uint64_t bytes = 0;  // of those lines, without their '\n'
};

// Trains a SentencePiece model on `inputs` (files, directories, .jsonl) as
// `detour-data tokenizer` does: DocumentReader's documents one line each
// (TextDocuments::kLines; a JSONL text with line breaks gives one line per
// line), empty lines left out, at most options.max_sentences lines, streamed
// into spm_train (TrainSentencePieceOnLines, scratch directory `scratch`).
// Errors: DocumentReader's, TrainSentencePieceOnLines's, and
// FAILED_PRECONDITION when the inputs hold no text.
absl::StatusOr<std::string> TrainTokenizerOnInputs(const SentencePieceTraining& options,
                                                   const std::vector<std::string>& inputs,
                                                   const std::string& jsonl_field,
                                                   const std::string& scratch,
                                                   TokenizerCorpus* corpus = nullptr);

struct ShardDataset {
  v1::DatasetManifest manifest;
  std::string manifest_checksum;  // "fnv1a64:<hex>" of manifest.json
  TokenSequence train;
  TokenSequence validation;
  // Document start offsets (documents + 1 entries) of each split.
  std::vector<uint64_t> train_documents;
  std::vector<uint64_t> validation_documents;
};

// Opens a dataset directory: validates the manifest (DATA_LOSS naming the
// field), checks every file's size against it and, with `verify`, every
// checksum and that every id is below the vocabulary (one pass over the
// mapped files). NOT_FOUND for a missing directory or file.
absl::StatusOr<ShardDataset> OpenShardDataset(const std::string& dir, bool verify = true);

// Reads and parses <dir>/manifest.json only (no file checks).
absl::StatusOr<v1::DatasetManifest> ReadDatasetManifest(const std::string& dir);

// What a checkpoint records about the data of a job with this DataSpec: the
// source, paths, split and the tokenizer's checksum (read from the tokenizer
// file or the dataset's manifest; "" when they cannot be read).
DataProvenance ProvenanceOf(const v1::DataSpec& data);

// The DataSpec that reads the data a checkpoint recorded.
v1::DataSpec DataSpecOf(const DataProvenance& provenance);

// LoadDataset for DATA_SOURCE_SHARDS: the dataset at data.path, checked
// against data.tokenizer (FAILED_PRECONDITION when the checksums differ) and
// data.validation_fraction (INVALID_ARGUMENT when set and different).
absl::StatusOr<TextDataset> LoadShardDataset(const v1::DataSpec& data);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_TOKEN_SHARDS_H_
