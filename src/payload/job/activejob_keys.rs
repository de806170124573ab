//! The keys ActiveJob's argument serializer (`activejob/lib/active_job/arguments.rb`) reserves in the
//! hashes it writes: the ActiveJob wire format as data, named once for the payload reader
//! ([`super::header`], which notes them in its single pass) and for the decoder above it
//! ([`crate::activejob`]).
//!
//! Part of the payload layer (docs/layout.md): it uses nothing of the crate.

/// `arguments.rb` `GLOBALID_KEY`.
pub(crate) const GLOBALID_KEY: &str = "_aj_globalid";
/// `arguments.rb` `OBJECT_SERIALIZER_KEY`.
pub(crate) const SERIALIZER_KEY: &str = "_aj_serialized";
/// `arguments.rb` `SYMBOL_KEYS_KEY`.
pub(crate) const SYMBOL_KEYS_KEY: &str = "_aj_symbol_keys";
/// `arguments.rb` `RUBY2_KEYWORDS_KEY`.
pub(crate) const RUBY2_KEYWORDS_KEY: &str = "_aj_ruby2_keywords";
/// `arguments.rb` `WITH_INDIFFERENT_ACCESS_KEY`.
pub(crate) const INDIFFERENT_KEY: &str = "_aj_hash_with_indifferent_access";
