//! Who the caller is and what it may do: identities and the identity headers sent upstream,
//! authentication (client certificates, token file, offline-verified ServiceAccount JWTs,
//! TokenReview), authorization by SubjectAccessReview and impersonation checks.

pub mod authn;
pub mod authz;
pub mod identity;
